"""Chat templates rendered as transformers renders them, with jinja2 alone (no transformers import).

A chat template is Jinja source shipped with a tokenizer. transformers 5 compiles it in an immutable sandbox with
`trim_blocks` and `lstrip_blocks`, loop controls (`break`/`continue`), a `tojson` filter that does not escape
HTML (`json.dumps`, non-ASCII kept), and the globals `raise_exception` (a template error), `strftime_now`
(today's date), `dict` and `namespace`; it renders each conversation with `messages`, `tools` (None unless given),
`documents=None`, `add_generation_prompt` and the tokenizer's named special tokens (overridden by the caller's
keyword arguments). Messages reach the template as plain JSON data, a message's reasoning under all its names.
This reproduces that for the text-only chats FLUX encodes, so the rendered text (and then the ids) are the same.
jinja2 comes with torch, so it is always installed.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the names a message's reasoning may come under, the first the one templates read
_REASONING = ("reasoning_content", "thinking", "reasoning")


def _raise(message: str) -> None:
    """The template's `raise_exception(message)`: fail rendering with its message."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """`tojson` as chat templates expect it: plain `json.dumps`, non-ASCII kept, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Today's local date and time in `fmt` (templates that print a date)."""
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates, without exposing the type itself to attribute access."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace` refusing underscore-prefixed attributes (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` is args[0]
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes on a namespace ({name!r})"
            )


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandboxed environment described in this module's docstring (cached by source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def plain(value: Any) -> Any:
    """`value` as plain JSON data (str, int, float, bool, None, dicts, lists, tuples); any other object becomes a
    placeholder naming its type, as transformers hands template data over."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with None values dropped and its reasoning (if any) under `thinking` and `reasoning_content`."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """One conversation `messages` rendered with `template`, `add_generation_prompt`, `tools` (JSON schemas) and
    `variables` (e.g. the tokenizer's special tokens, `enable_thinking`), as `apply_chat_template(messages,
    tokenize=False)` does."""
    if not messages:
        raise ValueError("cannot render an empty conversation: give at least one message")
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages are dicts, got {message!r}")
    chat = [_message(plain(m)) for m in messages]
    return compile_template(template).render(
        messages=chat,
        tools=plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **plain(variables),
    )
