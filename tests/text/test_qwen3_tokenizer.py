"""Our Qwen3 tokenizer and chat-template rendering against transformers' `Qwen2TokenizerFast`, over hard prompts.

Folders: the shipped tiny tokenizer, and variants in the layouts real Qwen3 folders use (extra special tokens
listed in the config, added tokens that are not special, a ByteLevel post-processor, the chat template in
`chat_template.jinja` beside one in the config, special tokens only in `special_tokens_map.json`, left padding and
truncation, split special tokens). Each must give the same serialized backend, the same rendered chat (a template
using namespaces, loop controls, `tojson`, the special-token variables, `raise_exception` and `strftime_now`),
the same ids and attention mask padded and truncated as FLUX.2 [klein] asks, and the same decoded text.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from transformers import Qwen2TokenizerFast

from flux_runtime.text.chat import load_qwen3_tokenizer, tokenize_chats
from flux_runtime.text.chat_template import render_chat
from flux_runtime.text.fast_tokenizers import FastTokenizer, qwen2_native_reason
from flux_runtime.text.tokenizers import TINY_TOKENIZERS

SHIPPED = TINY_TOKENIZERS / "qwen3"
HARD_PROMPTS = [
    "",
    " ",
    "a red circle",
    "  leading and trailing spaces  ",
    "\n\nnew\r\nlines\tand\ttabs\n",
    "Ünïcödé: naïve café, e\u0301 (combining), 日本語のテキスト, русский, العربية",
    "emoji 🐱🚀👩‍👩‍👧 flags 🇫🇷 and skin tones 👍🏽",
    "{{ messages }} {% if true %}x{% endif %} {# comment #} {{ raise_exception('no') }}",
    "<|im_start|>assistant\n<|im_end|> <think>hidden</think> <|endoftext|>",
    "Don't I'LL we've 123456 3.14159 1,000,000 — ‘quotes’ “double” <b>html</b> & ampersand",
    "a castle on a hill at sunset, fantasy style, highly detailed, " * 60,  # truncates at 512
]
# A chat template of our own exercising what Qwen3's uses: namespaces, loop controls, tests, tojson, the special-
# token variables, raise_exception, strftime_now, reasoning fields and the thinking switch; block tags without
# dashes rely on trim_blocks / lstrip_blocks.
TEMPLATE = """{%- set ns = namespace(last_user=-1, turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
<|im_start|>system
{{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('role ' + message.role + ' is not supported') }}
    {% endif %}
    {% if ns.turns >= 50 %}{% break %}{% endif %}
    {% set content = message.content if message.content is string else '' %}
    {% if message.role == 'assistant' and not content and not message.reasoning_content %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' and loop.index0 > ns.last_user and message.reasoning_content %}
<think>
{{ message.reasoning_content.strip('\\n') }}
</think>

    {% endif %}
{{ content }}{{ eos_token }}
{% if message.meta is defined %}{{ message.meta | tojson }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
    {% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

    {% endif %}
{% endif %}
{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}
"""
EXTRA = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<tool_call>"]


def _variant(root: Path, name: str) -> Path:
    """A copy of the shipped tokenizer changed as `name` says (see the module docstring)."""
    folder = root / name
    shutil.copytree(SHIPPED, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    if name in ("qwen3-layout", "left-sides", "split-special", "special-map"):
        # Qwen3's layout: more added tokens (one not special), extra special tokens listed, eos <|im_end|>
        for content, special in (("<|object_ref_start|>", True), ("<tool_call>", False)):
            entry = {"id": 517 + len(tok["added_tokens"]) - 5, "content": content, "single_word": False,
                     "lstrip": False, "rstrip": False, "normalized": False, "special": special}  # fmt: skip
            tok["added_tokens"].append(entry)
            config["added_tokens_decoder"][str(entry["id"])] = {k: v for k, v in entry.items() if k != "id"}
        config["additional_special_tokens"] = EXTRA
        config["chat_template"] = "{{ 'an outdated template the .jinja file replaces' }}"
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    if name == "left-sides":
        config["padding_side"] = config["truncation_side"] = "left"
    if name == "split-special":
        config["split_special_tokens"] = True
    if name == "special-map":  # the special tokens come from special_tokens_map.json and tokenizer.json only
        del config["added_tokens_decoder"], config["eos_token"], config["pad_token"]
        extra = {"additional_special_tokens": EXTRA}
        (folder / "special_tokens_map.json").write_text(
            json.dumps({**json.loads((folder / "special_tokens_map.json").read_text()), **extra})
        )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


VARIANTS = ["shipped", "qwen3-layout", "left-sides", "split-special", "special-map"]


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """(ours, transformers') for one folder variant."""
    name = request.param
    folder = SHIPPED if name == "shipped" else _variant(tmp_path_factory.mktemp("qwen3-tokenizers"), name)
    assert qwen2_native_reason(folder) is None
    ours = load_qwen3_tokenizer(folder)
    assert isinstance(ours, FastTokenizer)
    return ours, Qwen2TokenizerFast.from_pretrained(folder, local_files_only=True)


def _render(tokenizer: object, prompt: str) -> str:
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def test_same_backend_and_settings(pair: tuple[FastTokenizer, Qwen2TokenizerFast]) -> None:
    ours, ref = pair
    assert ours.backend.to_str() == ref.backend_tokenizer.to_str()
    assert ours.backend.get_added_tokens_decoder() == ref.backend_tokenizer.get_added_tokens_decoder()
    assert (ours.padding_side, ours.truncation_side) == (ref.padding_side, ref.truncation_side)
    assert ours.pad_token_id == ref.pad_token_id and len(ours) == len(ref)
    assert ours.chat_template == ref.chat_template and ours.special_tokens_map == ref.special_tokens_map


def test_rendered_chats_ids_and_masks_equal_transformers(
    pair: tuple[FastTokenizer, Qwen2TokenizerFast], caplog: pytest.LogCaptureFixture
) -> None:
    ours, ref = pair
    texts = [_render(ref, p) for p in HARD_PROMPTS]
    assert [_render(ours, p) for p in HARD_PROMPTS] == texts
    for length in (1, 64, 512):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            got = tokenize_chats(ours, texts, length, add_special_tokens=True, encoder="Qwen3")
            ours_log = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = tokenize_chats(ref, texts, length, add_special_tokens=True, encoder="Qwen3")
            assert ours_log == [r.getMessage() for r in caplog.records]  # the same truncation warnings
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].dtype == got[1].dtype == torch.int64
    assert ours(texts).input_ids == ref(texts).input_ids
    for text in texts:
        ids = ref(text).input_ids
        assert ours(text)["input_ids"] == ids and ours.decode(ids) == ref.decode(ids)


def test_template_features_render_as_transformers(pair: tuple[FastTokenizer, Qwen2TokenizerFast]) -> None:
    """A longer chat (system turn, reasoning, a message of other data, tools) and the raised template error."""
    ours, ref = pair
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": 'draw <a> & "b"'},
        {"role": "assistant", "content": "", "thinking": "\nlet me think\n"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again", "meta": {"k": "ünï <b>", "n": [1, 2.5, None, True]}},
    ]
    tools = [{"type": "function", "function": {"name": "paint", "description": "ß <tag>"}}]
    if "tools" not in (ours.chat_template or ""):  # the shipped template: plain string contents only
        chat = [
            chat[0],
            chat[1],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ]
    for kwargs in (
        {},
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "enable_thinking": False},
    ):
        want = ref.apply_chat_template(chat, tokenize=False, **kwargs)
        assert ours.apply_chat_template(chat, **kwargs) == want
    if "tools" in (ours.chat_template or ""):
        want = ref.apply_chat_template(chat, tools=tools, tokenize=False)
        assert render_chat(ours.chat_template, chat, tools=tools, **ours.special_tokens_map) == want
        with pytest.raises(jinja2.exceptions.TemplateError, match="role tool is not supported") as got:
            ours.apply_chat_template([{"role": "tool", "content": "x"}])
        with pytest.raises(jinja2.exceptions.TemplateError) as expected:
            ref.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
        assert str(got.value) == str(expected.value)


def test_render_checks_and_sandbox() -> None:
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat("{{ 1 }}", [])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [{"role": "user"}])
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", [{"role": "user"}])
    assert render_chat("{{ messages[0].content | tojson }}", [{"role": "user", "content": "é<"}]) == '"é<"'


def test_folders_read_through_transformers(tmp_path: Path) -> None:
    """What the native reader does not reproduce says why; `load_qwen3_tokenizer` then uses transformers."""
    folder = tmp_path / "named"
    shutil.copytree(SHIPPED, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["image_token"] = "<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert qwen2_native_reason(folder) == "model-specific special tokens"
    assert not isinstance(load_qwen3_tokenizer(folder), FastTokenizer)
    assert qwen2_native_reason(tmp_path) == "no tokenizer.json"
    del config["chat_template"], config["image_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert qwen2_native_reason(folder) == "no single chat template"
