"""Grouped `--help` for flux-gen, flux-convert and flux-serve, and the option reference written from it.

Click lists a command's options in one flat block, and flux-gen has about fifty. `GroupedCommand` prints them
under a few headings, one row each: the option's names and the first sentence of its help, with its default.
The rest of the help is for the reference page (`reference()`, written to docs/cli.md by
`scripts/cli_reference.py`, and checked by a test to be current). An option that no group names lands under
"Other options", in --help and in the reference alike, so a new option needs no edit here to be shown.

A command may declare its options as a table: `option()` rows under their headings (`OTHER` for the rest),
from which `table_params` and `table_groups` give click's parameters and `GroupedCommand`'s groups.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

OTHER = "Other options"
# where the full reference lives, for the --help epilogs
DOCS_PAGE = "docs/cli.md"
COLUMN = 26  # the widest names column; a longer one puts its text on the next line
_SENTENCE = re.compile(r"(?<=\.)\s")
_ITEM = re.compile(r"\s*\[(.*)\]")


class GroupedCommand(click.Command):
    """A click command whose --help shows its options under `groups`: (title, option names) pairs, the names
    click's parameter names (`num_images`, `loras`) separated by spaces; options not named come last, under
    "Other options"."""

    def __init__(self, *args: Any, groups: Sequence[tuple[str, str]] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = tuple((title, tuple(names.split())) for title, names in groups)

    def grouped_options(self, ctx: click.Context) -> list[tuple[str, list[click.Option]]]:
        """The command's options by group, in the groups' order, "Other options" last."""
        options = [p for p in self.get_params(ctx) if isinstance(p, click.Option) and not p.hidden]
        by_name = {p.name: p for p in options}
        out: list[tuple[str, list[click.Option]]] = []
        for title, names in self.groups:
            found = [by_name[name] for name in names if name in by_name]
            if found:
                out.append((title, found))
        named = {name for _, names in self.groups for name in names}
        rest = [p for p in options if p.name not in named]
        if rest:
            out.append((OTHER, rest))
        return out

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups = self.grouped_options(ctx)
        # one column width for every group, so the rows line up across headings
        width = min(max(len(spec(p)) for _, options in groups for p in options), COLUMN)
        for title, options in groups:
            rows = []
            for p in options:
                default = _extras(p, ctx).get("default")
                text = summary(p.help or "")
                rows.append((spec(p).ljust(width), f"{text}  [default: {default}]" if default else text))
            with formatter.section(title):
                formatter.write_dl(rows, col_max=COLUMN)


def summary(text: str) -> str:
    """The first sentence of a help text: what --help shows of it."""
    return _SENTENCE.split(text.strip(), maxsplit=1)[0]


def spec(p: click.Option) -> str:
    """`-m, --model NAME`: the option's names and a short word for its value (none for a flag)."""
    names = ", ".join(sorted(p.opts, key=len) + p.secondary_opts)
    value = _value(p)
    return f"{names} {value}" if value else names


def _value(p: click.Option) -> str:
    if p.is_flag or p.count:
        return ""
    if p.metavar:
        return p.metavar
    if isinstance(p.type, click.Choice):
        return "[" + "|".join(str(c) for c in p.type.choices) + "]"
    if isinstance(p.type, (click.types.IntParamType, click.IntRange)):
        return "N"
    if isinstance(p.type, (click.types.FloatParamType, click.FloatRange)):
        return "X"
    if isinstance(p.type, (click.Path, click.File)):
        return "PATH"
    return p.type.name.upper()


def _extras(p: click.Option, ctx: click.Context) -> dict[str, str]:
    """What click adds after an option's help ("default: 0", "x>=1", "required"), by kind."""
    record = p.get_help_record(ctx)
    # click writes them after the help text, in brackets
    found = _ITEM.fullmatch(record[1][len(p.help or "") :]) if record else None
    out: dict[str, str] = {}
    for item in found.group(1).split("; ") if found else ():
        key, sep, value = item.partition(": ")
        if sep and key in ("default", "env var"):
            out[key] = value
        elif item == "required":
            out["required"] = "yes"
        else:
            out["range"] = item
    return out


# ---------------------------------------------------------------------------------------------- option tables


FLAG = "flag"  # the value of an on/off option (off unless given)
NO_DEFAULT = object()  # no default given: click's own (None, or () for a repeatable option)
FILE = click.Path(exists=True, dir_okay=False, path_type=Path)  # an input file, which must exist


def option(names: str, value: Any, help: str, default: Any = None, **more: Any) -> click.Option:
    """A row of an option table: click's declarations, space-separated ("--out -o"; "--lora loras" names the
    parameter `loras`), its value (a click type, or FLAG), its help and its default; `more`: other click
    settings (multiple, metavar, show_default)."""
    if value is FLAG:
        return click.Option(names.split(), is_flag=True, help=help, **more)
    if default is not NO_DEFAULT:
        more["default"] = default
    return click.Option(names.split(), type=value, help=help, **more)


def table_params(table: Mapping[str, Sequence[click.Option]]) -> list[click.Option]:
    """An option table's options (headings to rows), in its order: a command's `params`."""
    return [p for options in table.values() for p in options]


def table_groups(table: Mapping[str, Sequence[click.Option]]) -> tuple[tuple[str, str], ...]:
    """An option table's headings with their options' names: `GroupedCommand`'s `groups`. The options under
    `OTHER` are left out, to be listed last under it as any option no group names."""
    return tuple(
        (title, " ".join(str(p.name) for p in options)) for title, options in table.items() if title != OTHER
    )


# ---------------------------------------------------------------------------------------------- the reference


def reference(commands: Sequence[tuple[str, click.Command]]) -> str:
    """docs/cli.md: every option of each command, by the groups its --help shows, with its whole help text."""
    lines = [
        "# Command line",
        "",
        "<!-- Written by `python3 scripts/cli_reference.py` from the click commands; a test checks it is",
        "     current. Edit the options' help in flux_runtime/cli/ or flux_runtime/serve/, then run it. -->",
        "",
        "Three commands come with the package: "
        + ", ".join(f"[`{n}`](#{n})" for n, _ in commands)
        + ". Each",
        "one's `--help` shows the same options, grouped, one line each; this page has their whole text.",
    ]
    for name, command in commands:
        ctx = click.Context(command, info_name=name, **command.context_settings)
        lines += ["", f"## {name}", "", "```text", command.get_usage(ctx), "```", ""]
        lines += [_cell_free(command.help or "")]
        args = [p for p in command.get_params(ctx) if isinstance(p, click.Argument)]
        if args:
            lines += ["", "Arguments: " + ", ".join(_argument(a) for a in args) + "."]
        groups = command.grouped_options(ctx) if isinstance(command, GroupedCommand) else []
        for title, options in groups:
            lines += [
                "",
                f"### {title}",
                "",
                "| option | value | default | what it does |",
                "|---|---|---|---|",
            ]
            for p in options:
                extras = _extras(p, ctx)
                value = _value(p) or "flag"
                if "range" in extras:
                    value += f", {extras['range']}"
                cells = [
                    ", ".join(f"`{o}`" for o in sorted(p.opts, key=len) + p.secondary_opts),
                    _cell(value),
                    _cell(extras.get("default", "")),
                    _cell(p.help or "")
                    + (" Repeatable." if p.multiple and "repeatable" not in (p.help or "") else ""),
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _argument(a: click.Argument) -> str:
    name = a.human_readable_name
    if isinstance(a.type, click.Choice):
        *first, last = [f"`{c}`" for c in a.type.choices]
        return f"`{name}` ({', '.join(first)} or {last})"
    return f"`{name}`"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _cell_free(text: str) -> str:
    """A command's docstring as Markdown paragraphs (click's `\\b` no-rewrap markers dropped)."""
    return "\n".join(line for line in inspect.cleandoc(text).splitlines() if line.strip() != "\b")
