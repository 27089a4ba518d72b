"""`--help` of flux-gen, flux-convert and flux-serve: grouped, one screen, every option named, a pointer to the
reference; docs/cli.md is what scripts/cli_reference.py writes from the same commands, so it cannot drift."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from flux_runtime.command_help import (
    DOCS_PAGE,
    FLAG,
    NO_DEFAULT,
    OTHER,
    GroupedCommand,
    option,
    reference,
    summary,
    table_groups,
    table_params,
)
from scripts.cli_reference import COMMANDS, PAGE, page

SCREEN = 80  # lines of --help at 100 columns (70 until the adapters' options came, 2026-12-04)


@pytest.mark.parametrize(("name", "command"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_help_is_grouped_short_and_names_every_option(name: str, command: click.Command) -> None:
    r = CliRunner().invoke(command, ["--help"], terminal_width=100)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) <= SCREEN, f"{name} --help is {len(lines)} lines"
    assert isinstance(command, GroupedCommand)
    for title, _ in command.groups:
        assert f"{title}:" in lines
    for p in command.params:
        if isinstance(p, click.Option):
            for opt in p.opts:
                assert opt in r.output, opt
    assert DOCS_PAGE in r.output


@pytest.mark.parametrize(("name", "command"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_groups_name_real_options(name: str, command: GroupedCommand) -> None:
    """A renamed or removed option must leave the groups too (it would otherwise vanish from its heading)."""
    params = {p.name for p in command.params}
    stale = [n for _, names in command.groups for n in names if n not in params]
    assert not stale, f"{name}: groups name {stale}, which are not options"


def test_an_option_no_group_names_is_listed_under_other_options() -> None:
    @click.command(cls=GroupedCommand, groups=(("Known", "known"),))
    @click.option("--known", help="Named by a group. More words.")
    @click.option("--brand-new", is_flag=True, help="Added later.")
    def cmd(**_: object) -> None:
        pass

    out = CliRunner().invoke(cmd, ["--help"]).output
    assert out.index("Known:") < out.index("--known") < out.index(f"{OTHER}:") < out.index("--brand-new")
    assert "Named by a group." in out and "More words" not in out  # --help shows the first sentence
    page = reference([("cmd", cmd)])
    assert f"### {OTHER}" in page and "`--brand-new`" in page and "Named by a group. More words." in page


def test_an_option_table_gives_the_params_and_the_groups() -> None:
    """Rows under headings: the options in the table's order, the headings naming theirs (OTHER's left to
    "Other options"); a flag is off, a value None unless given, NO_DEFAULT leaves click's own (() if repeated)."""
    table = {
        "Size": (
            option("--width -w", click.IntRange(min=1), "Width. In pixels."),
            option("--big", FLAG, "Big."),
        ),
        "Inputs": (option("--image images", str, "An image.", NO_DEFAULT, multiple=True),),
        OTHER: (option("--seed", int, "The seed.", 0),),
    }
    assert table_groups(table) == (("Size", "width big"), ("Inputs", "images"))

    @click.command(cls=GroupedCommand, groups=table_groups(table), params=table_params(table))
    def cmd(**opts: object) -> None:
        click.echo(repr(sorted(opts.items())))

    assert [p.name for p in cmd.params] == ["width", "big", "images", "seed"]
    out = CliRunner().invoke(cmd, []).output
    assert out.strip() == "[('big', False), ('images', ()), ('seed', 0), ('width', None)]"
    out = CliRunner().invoke(cmd, ["-w", "3", "--big", "--image", "a", "--image", "b"]).output
    assert out.strip() == "[('big', True), ('images', ('a', 'b')), ('seed', 0), ('width', 3)]"
    out = CliRunner().invoke(cmd, ["--help"]).output
    assert out.index("Size:") < out.index("-w, --width N") < out.index("Inputs:") < out.index(f"{OTHER}:")


def test_summary_is_the_first_sentence() -> None:
    assert (
        summary("FLUX.1 Kontext: output pixels. The size keeps --width.") == "FLUX.1 Kontext: output pixels."
    )
    assert (
        summary("cuda, cuda:1, cpu [default: cuda if available].")
        == "cuda, cuda:1, cpu [default: cuda if available]."
    )


def test_the_reference_page_is_current() -> None:
    assert PAGE.read_text() == page(), f"{PAGE.name} is not current: run python3 scripts/cli_reference.py"


def test_the_reference_page_names_every_option() -> None:
    text = Path(PAGE).read_text()
    for name, command in COMMANDS:
        assert f"## {name}" in text
        for p in command.params:
            if isinstance(p, click.Option):
                for opt in p.opts:
                    assert f"`{opt}`" in text, f"{name} {opt}"
