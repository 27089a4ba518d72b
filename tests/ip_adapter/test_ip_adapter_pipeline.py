"""The IP-Adapter on our pipeline beyond parity: where the adapter and its encoder come from (file, folder,
cached ids, `image_encoder/` beside it), one-line errors for bad inputs, memory plans and step caching keeping
the bits, and the provenance."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.memory import Plan
from flux_runtime.pipeline.placement import apply_plan, footprint
from flux_runtime.pipeline.provenance import check_record, image_fingerprint
from tests.ip_adapter.ip_fixtures import picture, save_adapter, xlabs_tensors
from tests.random_models import save_tensors

KW = dict(
    height=32, width=32, num_steps=3, guidance=3.5, seed=1, max_sequence_length=16, output_type="latent"
)
CFG = dict(negative_prompt="blurry", true_cfg_scale=2.0)


@pytest.fixture(scope="module")
def pipe(ip_files: dict) -> Pipeline:
    pipe = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    pipe.load_ip_adapter(ip_files["adapter"], 0.6, image_encoder=ip_files["clip"])
    return pipe


@pytest.fixture(scope="module")
def want(pipe: Pipeline) -> torch.Tensor:
    """The resident, uncached latents with true CFG: what every other arrangement must give."""
    return pipe("a fox", ip_adapter_image=picture(1), **KW, **CFG).latents


def _snapshot(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """`files` as the local Hugging Face cache holds a snapshot of `repo` (main at one commit)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snap / name)


def test_cached_ids_and_the_encoder_beside_the_adapter(
    ip_files: dict, want: torch.Tensor, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    _snapshot(
        cache,
        "XLabs-AI/flux-ip-adapter",
        {"ip_adapter.safetensors": ip_files["adapter"] / "ip_adapter.safetensors"},
    )
    clip = {f.name: f for f in ip_files["clip"].iterdir()}
    pipe = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    with pytest.raises(
        FluxError, match=r"needs a CLIP vision encoder and none was found .* pass image_encoder="
    ):
        pipe.load_ip_adapter("XLabs-AI/flux-ip-adapter", 0.6)
    _snapshot(cache, "openai/clip-vit-large-patch14", clip)  # the default encoder, from the cache
    record = pipe.load_ip_adapter("XLabs-AI/flux-ip-adapter", 0.6)
    assert record.encoder_path.endswith("snapshots/" + "0" * 40)
    assert record.path.endswith("snapshots/" + "0" * 40 + "/ip_adapter.safetensors")
    assert torch.equal(pipe("a fox", ip_adapter_image=picture(1), **KW, **CFG).latents, want)
    # an image_encoder/ folder beside the adapter comes first
    beside = tmp_path / "adapter"
    shutil.copytree(ip_files["adapter"], beside)
    shutil.copytree(ip_files["clip"], beside / "image_encoder")
    record = pipe.load_ip_adapter(beside / "ip_adapter.safetensors", 0.6)
    assert record.encoder_path == str(beside / "image_encoder")


def test_bad_inputs_are_one_line_errors(pipe: Pipeline, ip_files: dict, tmp_path) -> None:
    plain = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    clip = ip_files["clip"]
    lora = save_tensors({"transformer.x.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    wide = save_adapter(tmp_path / "wide", depth=3)  # made for a deeper transformer
    cases = [
        (
            lambda: plain.load_ip_adapter(tmp_path / "none.safetensors", image_encoder=clip),
            "neither an existing",
        ),
        (
            lambda: plain.load_ip_adapter(lora, image_encoder=clip),
            "lora.safetensors is not a FLUX IP-Adapter",
        ),
        (lambda: plain.load_ip_adapter(wide, image_encoder=clip), "its double blocks is 3, .*'s 2"),
        (
            lambda: plain.load_ip_adapter(ip_files["adapter"], image_encoder=tmp_path),
            "is not a CLIP vision encoder",
        ),
        (
            lambda: plain.load_ip_adapter(ip_files["adapter"], float("nan"), image_encoder=clip),
            "finite number",
        ),
        (
            lambda: plain.load_ip_adapter(ip_files["adapter"], [1.0], image_encoder=clip),
            "1 scales for 2 double",
        ),
        (lambda: plain.set_ip_adapter_scale(0.5), "no IP-Adapter is loaded"),
        (lambda: plain("a fox", ip_adapter_image=picture(1), **KW), "ip_adapter_image needs an IP-Adapter"),
        (lambda: pipe("a fox", **KW), "an IP-Adapter is loaded: pass ip_adapter_image"),
        (lambda: pipe("a fox", ip_adapter_image="fox.png", **KW), "ip_adapter_image"),
    ]
    for run, message in cases:
        with pytest.raises(FluxError, match=message) as err:
            run()
        assert "\n" not in str(err.value)
    assert plain.transformer.ip_adapter is None and plain.image_encoder is None  # nothing was half loaded


def test_flux2_refuses_an_ip_adapter(ip_files: dict) -> None:
    flux2 = Pipeline.from_pretrained("tiny-flux2", device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match=r"IP-Adapters are for FLUX\.1 models; tiny-flux2 is not one"):
        flux2.load_ip_adapter(ip_files["adapter"], image_encoder=ip_files["clip"])


def test_memory_plans_count_the_adapter_and_keep_the_bits(pipe: Pipeline, want: torch.Tensor) -> None:
    fp = footprint(pipe)
    adapter = sum(p.numel() * p.element_size() for p in pipe.transformer.ip_adapter.parameters())
    encoder = sum(p.numel() * p.element_size() for p in pipe.image_encoder.parameters())
    text = sum(
        p.numel() * p.element_size() for root in pipe.text_encoder.parts()[0] for p in root.parameters()
    )
    assert fp.dit.total >= adapter + sum(p.numel() * 4 for p in pipe.transformer.double_blocks.parameters())
    assert fp.text.total >= text + encoder
    cpu = torch.device("cpu")
    try:
        for plan in (
            Plan("swap", 1 << 40, text="offloaded", dit="offloaded", together=False),
            Plan(
                "stream",
                1 << 40,
                text="offloaded",
                dit="streamed",
                together=False,
                streamed_dit=(0, 2),
                slots=2,
            ),
        ):
            apply_plan(pipe, plan, cpu)
            assert torch.equal(pipe("a fox", ip_adapter_image=picture(1), **KW, **CFG).latents, want)
    finally:
        apply_plan(pipe, Plan("resident", None), cpu)


def test_a_step_cache_that_never_skips_keeps_the_bits(pipe: Pipeline, want: torch.Tensor) -> None:
    got = pipe("a fox", ip_adapter_image=picture(1), cache="first-block:threshold=0", **KW, **CFG)
    assert torch.equal(got.latents, want)


def test_provenance(pipe: Pipeline, ip_files: dict) -> None:
    import hashlib

    image, negative = picture(1), picture(4)
    info = pipe("a fox", ip_adapter_image=image, negative_ip_adapter_image=negative, **KW, **CFG).info
    check_record(info, "<call>")
    file = ip_files["adapter"] / "ip_adapter.safetensors"
    assert info["ip_adapter"] == {
        "name": "ip_adapter.safetensors",
        "path": str(file.absolute()),
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
        "scale": 0.6,
        "image_encoder": str(ip_files["clip"]),
    }
    images = info["ip_adapter_images"]
    assert images["ip_adapter_image"]["sha256"] == image_fingerprint(image)
    assert images["negative_ip_adapter_image"]["sha256"] == image_fingerprint(negative)


def test_the_diffusers_key_layout_reads_alike(
    pipe: Pipeline, want: torch.Tensor, ip_files: dict, tmp_path
) -> None:
    """The same weights under diffusers' keys (`image_proj.`, `ip_adapter.N.to_k_ip`) give the same bits."""
    renamed = {}
    for key, t in xlabs_tensors().items():
        key = key.replace("ip_adapter_proj_model.", "image_proj.")
        for kv in "kv":
            key = key.replace(f"processor.ip_adapter_double_stream_{kv}_proj", f"to_{kv}_ip")
        renamed[key.replace("double_blocks.", "ip_adapter.")] = t
    file = save_tensors(renamed, tmp_path / "diffusers-layout.safetensors")
    other = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    other.load_ip_adapter(file, 0.6, image_encoder=ip_files["clip"])
    assert torch.equal(other("a fox", ip_adapter_image=picture(1), **KW, **CFG).latents, want)


def test_loading_under_a_plan_plans_again(ip_files: dict, want: torch.Tensor) -> None:
    """An adapter loaded onto a pipeline already under a plan: the plan is made again with its weights (and
    its encoder's) counted and placed, and the bits stay."""
    other = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    apply_plan(
        other, Plan("swap", 1 << 40, text="offloaded", dit="offloaded", together=False), torch.device("cpu")
    )
    before = footprint(other).dit.total
    other.load_ip_adapter(ip_files["adapter"], 0.6, image_encoder=ip_files["clip"])
    models = other.placement.models
    assert any(root is other.image_encoder for root in models["text"].roots)
    assert footprint(other).dit.total > before
    assert torch.equal(other("a fox", ip_adapter_image=picture(1), **KW, **CFG).latents, want)
    encoder = other.image_encoder
    other.unload_ip_adapter()
    assert not any(root is encoder for root in other.placement.models["text"].roots)
    assert footprint(other).dit.total == before


class _StaticGraph:
    """A CUDA graph's contract on the CPU: every input (the IP tokens among them) copied into buffers made at
    the first call, the output one buffer overwritten by each call."""

    made = 0
    tier_used = None

    def __init__(self, fn) -> None:
        self.fn, self.inputs, self.out = fn, None, None
        _StaticGraph.made += 1

    def __call__(self, *xs):
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten(xs)
        if self.inputs is None:
            self.inputs = [None if x is None else x.clone() for x in leaves]
        for buf, x in zip(self.inputs, leaves, strict=True):
            if buf is not None:
                buf.copy_(x)
        y = self.fn(*pytree.tree_unflatten(self.inputs, spec))
        self.out = torch.empty_like(y) if self.out is None else self.out
        return self.out.copy_(y)


def test_each_branch_replays_its_own_image_tokens(pipe: Pipeline, want: torch.Tensor, monkeypatch) -> None:
    """Under graph-style static inputs and outputs (one graph per branch), cond and uncond keep their own image
    tokens: the latents are the eager ones."""
    monkeypatch.setattr(pipe, "_graphs_enabled", lambda: True)
    monkeypatch.setattr(pipe, "_new_graph", _StaticGraph)
    pipe._graphed.clear()
    try:
        got = pipe("a fox", ip_adapter_image=picture(1), **KW, **CFG)
        assert got.info["cuda_graphs"] is True and _StaticGraph.made == 2
        assert torch.equal(got.latents, want)
        # the negative branch really reads other tokens than the positive one: a black negative image
        # given outright changes nothing, another one changes the latents
        black = Image.new("RGB", (32, 32))
        assert torch.equal(
            pipe("a fox", ip_adapter_image=picture(1), negative_ip_adapter_image=black, **KW, **CFG).latents,
            want,
        )
        other = pipe("a fox", ip_adapter_image=picture(1), negative_ip_adapter_image=picture(6), **KW, **CFG)
        assert not torch.equal(other.latents, want)
    finally:
        pipe._graphed.clear()
