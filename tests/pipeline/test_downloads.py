"""A model's first run: `Pipeline.from_pretrained` fetches the repos its load reads (`fetch_model`), exactly the
planned files, from a local stand-in of the Hub (`online`), and loads from them; offline it touches nothing."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants

from flux_runtime.pipeline import FluxError, Pipeline, downloads
from flux_runtime.pipeline.downloads import fetch_model
from flux_runtime.registry import (
    CLIP_L_ID,
    FLUX3_UPSAMPLER_ID,
    MISTRAL_PROCESSOR_ID,
    MISTRAL_SMALL_ID,
    T5_XXL_ID,
)
from flux_runtime.weights.download import RepoPlan, Role, plan_files
from flux_runtime.weights.errors import WeightsError

SCHNELL = "black-forest-labs/FLUX.1-schnell"


def _load(name: str, **kw) -> Pipeline:
    pipe = Pipeline.from_pretrained(name, device="cpu", dtype=torch.float32, **kw)
    assert isinstance(pipe, Pipeline)
    return pipe


def test_a_first_run_fetches_its_plan_and_loads_from_it(online) -> None:
    pipe = _load("flux1-schnell")
    fetched = online.fetched(SCHNELL)
    assert sorted(fetched) == sorted(set(fetched))  # each file once
    assert not {"flux1-schnell.safetensors", "ae.safetensors", "README.md", "dev_grid.jpg"} & set(fetched)
    assert "transformer/diffusion_pytorch_model-00001-of-00003.safetensors" in fetched
    out = pipe("a fox", height=64, width=64, num_steps=1)
    assert out.info["hub"] == {"repo": SCHNELL, "revision": online.repos[SCHNELL].sha}
    online.log.clear()
    _load("flux1-schnell")  # the second run fetches nothing
    assert [(r.method, r.kind) for r in online.log] == [("GET", "info")]


def test_a_bfl_repo_the_registry_does_not_know_brings_its_text_encoders(online) -> None:
    _load("someone/flux1-finetune")
    assert sorted(online.fetched("someone/flux1-finetune")) == ["ae.safetensors", "finetune.safetensors"]
    for repo in (CLIP_L_ID, T5_XXL_ID):  # the pair a FLUX.1 BFL file takes, each in safetensors only
        fetched = online.fetched(repo)
        assert "model.safetensors" in fetched and "config.json" in fetched
        assert not {"pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "README.md"} & set(fetched)


def test_offline_and_download_false_touch_nothing(online, monkeypatch) -> None:
    with pytest.raises(WeightsError) as e:
        _load("flux1-schnell", download=False)
    assert str(e.value).startswith(
        f"'{SCHNELL}' is not in the local Hugging Face cache, and this load fetches"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1
    with pytest.raises(WeightsError, match="HF_HUB_OFFLINE=1"):
        _load("flux1-schnell")
    assert online.log == []
    with pytest.raises(FluxError, match="download must be True or False"):
        _load("flux1-schnell", download="yes")


def test_a_gated_model_says_how_to_get_in(online) -> None:
    with pytest.raises(WeightsError) as e:
        _load("flux1-dev")
    assert str(e.value).startswith("black-forest-labs/FLUX.1-dev is gated: accept its licence")
    assert online.fetched() == []


def test_built_in_models_fetch_nothing(online) -> None:
    assert fetch_model("tiny") == [] and fetch_model("tiny-flux2-random") == []
    assert online.log == []


def _planned(monkeypatch, listings: dict[str, list[str]]) -> list[tuple[str, Role]]:
    """Stand `fetch_model`'s planning on these file lists (no network, nothing fetched); what it planned."""
    asked: list[tuple[str, Role]] = []

    def plan_repo(repo: str, role: Role, *, text: bool = True) -> RepoPlan:
        asked.append((repo, role))
        files = dict.fromkeys(
            plan_files(listings.get(repo, ["config.json", "model.safetensors"]), role, text=text), 1
        )
        return RepoPlan(repo, role, "0" * 40, files, len(files), files)

    monkeypatch.setattr(downloads, "plan_repo", plan_repo)
    monkeypatch.setattr(downloads, "fetch", lambda plans: None)
    return asked


def test_registry_models_plan_their_other_repos_up_front(monkeypatch) -> None:
    bfl = ["flux2-dev.safetensors", "ae.safetensors"]
    diffusers = [
        "transformer/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "ae.safetensors",
    ]
    asked = _planned(monkeypatch, {"black-forest-labs/FLUX.2-dev": bfl})
    fetch_model("flux2-dev")  # a repo without text encoders: BFL's pair, Mistral 3.1 for its processor only
    assert asked == [
        ("black-forest-labs/FLUX.2-dev", "pipeline"),
        (MISTRAL_SMALL_ID, "model"),
        (MISTRAL_PROCESSOR_ID, "tokenizer"),
    ]
    asked = _planned(monkeypatch, {"black-forest-labs/FLUX.2-dev": diffusers})
    fetch_model("flux2-dev", loras=["someone/a-lora", "./local.safetensors"])  # its own text encoder
    assert asked == [("black-forest-labs/FLUX.2-dev", "pipeline"), ("someone/a-lora", "lora")]
    asked = _planned(monkeypatch, {"black-forest-labs/flux-3-image-klein": diffusers})
    fetch_model("flux3-klein")
    assert asked == [("black-forest-labs/flux-3-image-klein", "pipeline"), (FLUX3_UPSAMPLER_ID, "model")]
    asked = _planned(monkeypatch, {"black-forest-labs/flux-3-image-klein": diffusers})
    fetch_model("flux3-klein", upsampler=False, text_encoder="Qwen/Qwen3-VL-4B-Instruct")
    assert asked == [
        ("black-forest-labs/flux-3-image-klein", "pipeline"),
        ("Qwen/Qwen3-VL-4B-Instruct", "model"),
    ]
