"""Fetching from the Hub: the file plans (exactly what the loaders read) and the transfer through huggingface_hub,
against a local stand-in of the Hub (`online`): one copy of each weight, nothing twice, and each failure a first
run meets in one line before any large transfer (gated, no network, disk) or resumed (a dropped connection, a
run that stopped)."""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants

from flux_runtime.weights import download
from flux_runtime.weights.checkpoint import find_transformer_files
from flux_runtime.weights.download import fetch, plan_files, plan_repo
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import cached_snapshot
from tests.hub_repos import TINY
from tests.hub_server import ACCEPTED_TOKEN

SCHNELL = "black-forest-labs/FLUX.1-schnell"
DEV = "black-forest-labs/FLUX.1-dev"
# FLUX.1-dev's repo as the Hub lists it: both transformer layouts, both autoencoder layouts.
FLUX1_DEV_LISTING = [
    ".gitattributes", "LICENSE.md", "README.md", "ae.safetensors", "dev_grid.jpg", "flux1-dev.safetensors",
    "model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
    "text_encoder/model.safetensors", "text_encoder_2/config.json",
    "text_encoder_2/model-00001-of-00002.safetensors", "text_encoder_2/model-00002-of-00002.safetensors",
    "text_encoder_2/model.safetensors.index.json", "tokenizer/merges.txt", "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json", "tokenizer/vocab.json", "tokenizer_2/special_tokens_map.json",
    "tokenizer_2/spiece.model", "tokenizer_2/tokenizer.json", "tokenizer_2/tokenizer_config.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
]  # fmt: skip
TEXT_FOLDERS = ("text_encoder/", "text_encoder_2/", "tokenizer/", "tokenizer_2/")


# --------------------------------------------------------------------------------------------------
# the plans


def test_a_repo_with_both_layouts_is_planned_as_its_diffusers_folders() -> None:
    plan = plan_files(FLUX1_DEV_LISTING, "pipeline")
    weights = [p for p in plan if p.endswith(".safetensors")]
    assert weights == [
        "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00003.safetensors",
        "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
        "text_encoder/model.safetensors",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    left = set(FLUX1_DEV_LISTING) - set(plan)
    assert left == {
        ".gitattributes",
        "LICENSE.md",
        "README.md",
        "ae.safetensors",
        "dev_grid.jpg",
        "flux1-dev.safetensors",
    }
    # other text encoders given: the repo's are not fetched
    assert not [
        p for p in plan_files(FLUX1_DEV_LISTING, "pipeline", text=False) if p.startswith(TEXT_FOLDERS)
    ]


def test_a_bfl_file_set_is_planned_as_the_loader_picks_it(tmp_path: Path) -> None:
    # two transformer files at the root (a bf16 one and, say, an FP8 one): the plan takes the one the loader
    # takes, so a folder holding only the planned files loads that file
    for name in ("flux1-dev.safetensors", "flux1-dev-fp8.safetensors", "ae.safetensors"):
        shutil.copy(
            TINY / ("ae.safetensors" if name == "ae.safetensors" else "flux1-tiny.safetensors"),
            tmp_path / name,
        )
    listing = [p.name for p in tmp_path.iterdir()] + ["README.md"]
    plan = plan_files(listing, "pipeline")
    assert plan == ["flux1-dev-fp8.safetensors", "ae.safetensors"]
    assert find_transformer_files(tmp_path) == [tmp_path / plan[0]]
    (tmp_path / "flux1-dev.safetensors").unlink()  # what the plan leaves out is not there
    assert find_transformer_files(tmp_path) == [tmp_path / plan[0]]
    with pytest.raises(WeightsError, match="holds no FLUX transformer"):
        plan_files(["README.md", "ae.safetensors"], "pipeline")


def test_a_model_repo_gives_one_copy_of_its_weights() -> None:
    clip = [
        "README.md",
        "config.json",
        "flax_model.msgpack",
        "merges.txt",
        "model.safetensors",
        "pytorch_model.bin",
    ]
    clip += [
        "special_tokens_map.json",
        "tf_model.h5",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert [p for p in plan_files(clip, "model") if not p.endswith(download.CONFIG_SUFFIXES)] == [
        "model.safetensors"
    ]
    # Mistral Small 3.2: its own single file beside the transformers shards
    mistral = [
        "config.json",
        "consolidated.safetensors",
        "model.safetensors.index.json",
        "params.json",
        "tekken.json",
    ]
    mistral += [f"model-{i:05d}-of-00010.safetensors" for i in range(1, 11)]
    weights = [p for p in plan_files(mistral, "model") if p.endswith(".safetensors")]
    assert weights == [f"model-{i:05d}-of-00010.safetensors" for i in range(1, 11)]
    assert plan_files(mistral, "tokenizer") == ["config.json", "params.json", "tekken.json"]  # no weights
    # PyTorch weights where a repo has no safetensors (transformers reads them)
    t5 = ["config.json", "pytorch_model.bin", "spiece.model", "tf_model.h5", "tokenizer_config.json"]
    assert plan_files(t5, "model") == [
        "config.json",
        "spiece.model",
        "tokenizer_config.json",
        "pytorch_model.bin",
    ]
    with pytest.raises(WeightsError, match="no model weights"):
        plan_files(["config.json", "tf_model.h5"], "model")
    # a diffusers pipeline named as a text encoder: its text folders only
    assert all(p.startswith(TEXT_FOLDERS) for p in plan_files(FLUX1_DEV_LISTING, "model"))


def test_lora_and_vae_plans() -> None:
    assert plan_files(["README.md", "lora.safetensors"], "lora") == ["lora.safetensors"]
    assert plan_files(["a.safetensors", "pytorch_lora_weights.safetensors"], "lora") == [
        "pytorch_lora_weights.safetensors"
    ]
    with pytest.raises(WeightsError, match=r"a LoRA is one \.safetensors file"):
        plan_files(["a.safetensors", "b.safetensors"], "lora")
    assert plan_files(FLUX1_DEV_LISTING, "vae") == [
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert plan_files(["ae.safetensors", "flux1-dev.safetensors"], "vae") == ["ae.safetensors"]


def test_controlnet_plans() -> None:
    """A diffusers ControlNet repo: its config and weights, not its sample images; an XLabs repo: its one file."""
    instantx = ["README.md", "config.json", "diffusion_pytorch_model.safetensors", "images/canny.jpg"]
    assert plan_files(instantx, "controlnet") == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert plan_files(["README.md", "flux-canny-controlnet-v3.safetensors"], "controlnet") == [
        "flux-canny-controlnet-v3.safetensors"
    ]
    with pytest.raises(
        WeightsError, match=r"a ControlNet is one \.safetensors file: download the one you want"
    ):
        plan_files(["canny-v2.safetensors", "canny-v3.safetensors"], "controlnet")


# --------------------------------------------------------------------------------------------------
# against the stand-in Hub


def test_the_plan_fetches_its_files_once(online) -> None:
    plan = plan_repo(SCHNELL, "pipeline")
    assert plan is not None and plan.missing == plan.files and plan.size < plan.repo_size
    fetch([plan])
    assert sorted(online.fetched(SCHNELL)) == sorted(plan.files)  # the server sent these files, once each
    snapshot = cached_snapshot(SCHNELL)
    assert snapshot is not None
    on_disk = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert on_disk == set(plan.files)  # one copy of each weight: no BFL file, no ae.safetensors
    online.log.clear()
    again = plan_repo(SCHNELL, "pipeline")
    assert again is not None and again.missing == {}
    fetch([again])
    assert [(r.method, r.kind) for r in online.log] == [("GET", "info")]  # a second run fetches nothing


def test_a_new_commit_with_the_same_weights_sends_nothing_again(online, tmp_path) -> None:
    fetch([plan_repo(SCHNELL, "pipeline")])
    repo = online.repos[SCHNELL]
    (tmp_path / "NOTICE.md").write_text("a new commit\n")
    repo.files["NOTICE.md"] = tmp_path / "NOTICE.md"  # main moves on; the planned files stay the same
    try:
        online.log.clear()
        plan = plan_repo(SCHNELL, "pipeline")
        assert plan is not None and plan.revision == repo.sha and set(plan.missing) == set(plan.files)
        assert plan.to_fetch == 0  # the disk check asks for nothing: every blob is in the cache
        fetch([plan])
        assert online.fetched() == []  # linked from the blobs, none sent again
        snapshot = cached_snapshot(SCHNELL)
        assert snapshot is not None and snapshot.name == repo.sha
    finally:
        del repo.files["NOTICE.md"]


def test_a_gated_repo_is_one_line_before_any_weights(online, monkeypatch) -> None:
    plan = plan_repo(DEV, "pipeline")
    assert plan is not None  # its listing is public, as on the Hub
    for token in (None, "hf_not_accepted"):
        if token is not None:
            monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(WeightsError) as e:
            fetch([plan])
        message = str(e.value)
        assert len(message.splitlines()) == 1 and message.startswith(f"{DEV} is gated: accept its licence")
        assert f"{online.url}/{DEV}" in message and "hf auth login" in message and "HF_TOKEN" in message
        assert online.fetched() == []
        assert not [r for r in online.log if r.kind == "file" and r.path.endswith(".safetensors")]
    monkeypatch.setenv("HF_TOKEN", ACCEPTED_TOKEN)  # accepted and logged in: it comes
    fetch([plan])
    assert sorted(online.fetched(DEV)) == sorted(plan.files)


def test_not_enough_disk_is_one_line_with_both_sizes(online, monkeypatch) -> None:
    plan = plan_repo(SCHNELL, "pipeline")
    assert plan is not None
    monkeypatch.setattr(download, "free_bytes", lambda folder: 2_000_000)
    with pytest.raises(WeightsError) as e:
        fetch([plan])
    message = str(e.value)
    assert message.startswith(
        f"not enough disk space to fetch {SCHNELL}: {download.size_text(plan.size)} needed"
    )
    assert "2.0 MB free in" in message and "HF_HUB_CACHE" in message and len(message.splitlines()) == 1
    assert [r.kind for r in online.log] == ["info"]  # nothing was fetched


def test_no_network_is_one_line_and_a_cached_repo_still_loads(online, monkeypatch, caplog) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    with pytest.raises(WeightsError) as e:
        plan_repo(SCHNELL, "pipeline")
    message = str(e.value)
    assert message.startswith(f"cannot reach the Hugging Face Hub ({closed}) to fetch {SCHNELL}")
    assert "pass the path of local weights" in message and len(message.splitlines()) == 1
    monkeypatch.setattr(constants, "ENDPOINT", online.url)
    fetch([plan_repo(SCHNELL, "pipeline")])
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    with caplog.at_level(logging.WARNING, logger="flux_runtime.weights.download"):
        assert plan_repo(SCHNELL, "pipeline") is None  # the load goes on from the cache
    assert "is read from the local cache" in caplog.text


def test_an_unknown_repo_is_one_line(online) -> None:
    with pytest.raises(WeightsError, match=r"^nobody/nothing is not on the Hugging Face Hub, or is private"):
        plan_repo("nobody/nothing", "pipeline")


def test_a_dropped_connection_resumes_where_it_stopped(online, monkeypatch) -> None:
    # huggingface_hub writes what arrives in chunks of 10 MB: smaller ones here, so that a drop half way through
    # this 4 MB shard leaves written bytes to resume from
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    shard = "transformer/diffusion_pytorch_model-00001-of-00003.safetensors"
    online.drop_once.add((SCHNELL, shard))
    plan = plan_repo(SCHNELL, "pipeline")
    assert plan is not None
    fetch([plan])
    gets = [r for r in online.log if r.kind == "file" and r.method == "GET" and r.path == shard]
    assert gets[0].range is None and gets[1].range is not None and gets[1].status == 206
    assert int(gets[1].range.removeprefix("bytes=").rstrip("-")) > 0  # from where the first answer stopped
    served = online.repos[SCHNELL].files[shard]
    snapshot = cached_snapshot(SCHNELL)
    assert snapshot is not None and (snapshot / shard).read_bytes() == served.read_bytes()


def test_a_run_that_stopped_is_finished_by_the_next(online) -> None:
    shard = "text_encoder_2/model-00002-of-00002.safetensors"
    online.fail.add((SCHNELL, shard))
    plan = plan_repo(SCHNELL, "pipeline")
    assert plan is not None
    with pytest.raises(WeightsError, match=r"answered 500 .*the files already fetched are kept"):
        fetch([plan])
    first = set(online.fetched(SCHNELL))
    assert shard not in first and first  # the files that finished before the run stopped are kept
    online.reset()
    again = plan_repo(SCHNELL, "pipeline")
    assert again is not None and shard in again.missing
    assert set(again.missing) == set(plan.files) - first  # what is left: the failed file, and any not begun
    fetch([again])
    assert sorted(online.fetched(SCHNELL)) == sorted(again.missing)  # nothing fetched twice
