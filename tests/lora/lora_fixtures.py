"""Tiny FLUX models and LoRA files written in each real key layout, with diffusers as the reference; LoRA files
fused as the pipeline fuses them, and as diffusers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime.weights import flux1_layout, flux2_layout, load_transformer
from flux_runtime.weights.lora import FusedState, fuse
from flux_runtime.weights.lora_formats import LoraWeights, convert, open_lora, read_lora
from flux_runtime.weights.lora_layers import LayerTable

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# diffusers module names by our (BFL) layer, for writing the layouts that name BFL modules
FLUX1_DOUBLE = ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2", "img_mod.lin", "txt_attn.qkv",
                "txt_attn.proj", "txt_mlp.0", "txt_mlp.2", "txt_mod.lin")  # fmt: skip
FLUX1_SINGLE = ("linear1", "linear2", "modulation.lin")
FLUX2_DOUBLE = ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2", "txt_attn.qkv", "txt_attn.proj",
                "txt_mlp.0", "txt_mlp.2")  # fmt: skip
FLUX2_SINGLE = ("linear1", "linear2")
FLUX3_BLOCK = (
    "q_proj",
    "k_proj",
    "v_proj",
    "attn_out",
    "mlp_in",
    "mlp_out",
)  # per-mode and single blocks alike


def bfl_shapes(model_sd: dict[str, torch.Tensor], family: str, depth: int, depth_single: int, guidance: bool):
    """{bfl module: (out, in)} of a diffusers state dict's model, through the layout table."""
    layout = flux1_layout if family == "flux1" else flux2_layout
    out = {}
    for rule in layout.rules(depth, depth_single, guidance):
        if rule.bfl.endswith(".weight"):
            parts = [model_sd[d] for d in rule.diffusers]
            out[rule.bfl.removesuffix(".weight")] = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    return out


def factors(shape: tuple[int, int], rank: int, gen: torch.Generator, dtype=torch.float32):
    out_f, in_f = shape
    down = (torch.randn(rank, in_f, generator=gen) * 0.3).to(dtype)
    up = (torch.randn(out_f, rank, generator=gen) * 0.3).to(dtype)
    return down, up


def kohya_file(path: Path, shapes: dict, modules: list[str], *, rank=4, alpha=2.0, dtype=torch.float32,
               seed=0, te: dict | None = None, comfy: bool = False) -> Path:  # fmt: skip
    """sd-scripts keys `lora_unet_<module with _>.lora_down/.lora_up/.alpha` (ComfyUI: `diffusion_model.<module>.`)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for m in modules:
        down, up = factors(shapes[m], rank, gen, dtype)
        name = f"diffusion_model.{m}" if comfy else "lora_unet_" + m.replace(".", "_")
        sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = down, up
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(alpha, dtype=dtype)
    for m, shape in (te or {}).items():
        down, up = factors(shape, rank, gen, dtype)
        name = "lora_te1_" + m.replace(".", "_")
        sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = down, up
        sd[f"{name}.alpha"] = torch.tensor(alpha, dtype=dtype)
    save_file(sd, str(path))
    return path


def peft_file(path: Path, shapes: dict, modules: list[str], *, rank=4, alphas: dict | None = None,
              prefix="transformer.", dtype=torch.float32, seed=0, metadata: dict | None = None) -> Path:  # fmt: skip
    """diffusers/PEFT keys `[transformer.]<diffusers module>.lora_A/B.weight`, optional `.alpha` tensors."""
    import json

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for m in modules:
        down, up = factors(shapes[m], rank, gen, dtype)
        sd[f"{prefix}{m}.lora_A.weight"], sd[f"{prefix}{m}.lora_B.weight"] = down, up
        if alphas and m in alphas:
            sd[f"{prefix}{m}.alpha"] = torch.tensor(alphas[m], dtype=dtype)
    header = None
    if metadata is not None:
        header = {
            "format": "pt",
            "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in metadata.items()}),
        }
    save_file(sd, str(path), metadata=header)
    return path


def bfl_file(path: Path, shapes: dict, modules: list[str], *, rank=4, prefix="diffusion_model.",
             dtype=torch.float32, seed=0, bias=False, norms: dict | None = None, widths: dict | None = None) -> Path:  # fmt: skip
    """BFL module names with lora_A / lora_B (ai-toolkit, fal `base_model.model.`, BFL control LoRAs)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for m in modules:
        shape = shapes[m] if not widths or m not in widths else (shapes[m][0], widths[m])
        down, up = factors(shape, rank, gen, dtype)
        sd[f"{prefix}{m}.lora_A.weight"], sd[f"{prefix}{m}.lora_B.weight"] = down, up
        if bias:
            sd[f"{prefix}{m}.lora_B.bias"] = (torch.randn(shape[0], generator=gen) * 0.1).to(dtype)
    for k, n in (norms or {}).items():
        sd[f"{prefix}{k}"] = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    save_file(sd, str(path))
    return path


def xlabs_file(path: Path, shapes: dict, depth: int, depth_single: int, *, rank=4, seed=0) -> Path:
    """XLabs processor keys: qkv_lora1/2 and proj_lora1/2 per double block, qkv_lora / proj_lora per single."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(depth):
        for proc, m in (("qkv_lora1", "img_attn.qkv"), ("qkv_lora2", "txt_attn.qkv"),
                        ("proj_lora1", "img_attn.proj"), ("proj_lora2", "txt_attn.proj")):  # fmt: skip
            down, up = factors(shapes[f"double_blocks.{i}.{m}"], rank, gen)
            sd[f"double_blocks.{i}.processor.{proc}.down.weight"] = down
            sd[f"double_blocks.{i}.processor.{proc}.up.weight"] = up
    for i in range(depth_single):
        h = shapes[f"single_blocks.{i}.linear2"][0]
        for proc, shape in (("qkv_lora", (3 * h, h)), ("proj_lora", shapes[f"single_blocks.{i}.linear2"])):
            down, up = factors(shape, rank, gen)
            sd[f"single_blocks.{i}.processor.{proc}.down.weight"] = down
            sd[f"single_blocks.{i}.processor.{proc}.up.weight"] = up
    save_file(sd, str(path))
    return path


def blocks(family: str, depth: int, depth_single: int) -> list[str]:
    """Every block projection of a model (BFL names)."""
    double, single = (FLUX1_DOUBLE, FLUX1_SINGLE) if family == "flux1" else (FLUX2_DOUBLE, FLUX2_SINGLE)
    return [f"double_blocks.{i}.{m}" for i in range(depth) for m in double] + [
        f"single_blocks.{i}.{m}" for i in range(depth_single) for m in single
    ]


def flux3_blocks(depth: int, depth_single: int) -> list[str]:
    """Every block projection of a FLUX.3 model (BFL names): per-mode blocks of each mode, then the single ones."""
    groups = ["content_mode_blocks.image", "content_mode_blocks.image_cond", "txt_mode_blocks"]
    per_mode = [f"{g}.{i}.{m}" for g in groups for i in range(depth) for m in FLUX3_BLOCK]
    return per_mode + [f"single_blocks.{i}.{m}" for i in range(depth_single) for m in FLUX3_BLOCK]


def linear_shapes(model) -> dict[str, tuple[int, int]]:
    """{module: (out, in)} of every projection of one of our models (BFL names)."""
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if hasattr(m, "in_features")}


def diffusers_shapes(model_sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """{diffusers module: (out, in)} of every Linear weight in a diffusers state dict."""
    return {
        k.removesuffix(".weight"): tuple(v.shape)
        for k, v in model_sd.items()
        if k.endswith(".weight") and v.ndim == 2
    }


def fused_bfl(model, family: str) -> dict[str, torch.Tensor]:
    """A diffusers model's (fused) weights in our BFL layout."""
    sd = model.state_dict()
    cfg = model.config
    if family == "flux1":
        table = flux1_layout.rules(cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds)
        return {r.bfl: flux1_layout.diffusers_to_bfl(r, sd.__getitem__) for r in table}
    guidance = any(k.startswith("time_guidance_embed.guidance_embedder.") for k in sd)
    table = flux2_layout.rules(cfg.num_layers, cfg.num_single_layers, guidance)
    return {r.bfl: flux2_layout.diffusers_to_bfl(r, sd.__getitem__) for r in table}


def converted(path: Path, table: LayerTable, clip: set[str] | None = None) -> LoraWeights:
    """The LoRA file at `path` read and converted for the model `table` describes (`clip`: CLIP-L's modules)."""
    file, data, _ = open_lora(path)
    sd, meta = read_lora(data, file.name)
    return convert(sd, meta, table, clip, file.name)


def fuse_file(model, path: Path, scale: float, state: FusedState):
    """The LoRA file at `path` fused into `model` at `scale` (recorded in `state`) as the pipeline fuses it:
    (the fuse's report, the file's common form, the model's layer table)."""
    table = LayerTable.of(model)
    weights = converted(path, table)
    return fuse(model, table, weights, scale, state, text_encoder=None, name=path.name), weights, table


def ours(folder: Path, dtype: torch.dtype, files_scales, state: FusedState | None = None):
    """The transformer in `folder` loaded on the CPU in `dtype`, each (LoRA file, scale) fused in order:
    (the model, the fused state)."""
    model = load_transformer(folder, device="cpu", dtype=dtype)
    state = state or FusedState()
    for path, scale in files_scales:
        fuse_file(model, path, scale, state)
    return model, state


def diffusers_fused(pipe, files_scales):
    """diffusers' `pipe` with each (LoRA file, scale) fused in order: load_lora_weights + fuse_lora(lora_scale) +
    unload_lora_weights per file."""
    for path, scale in files_scales:
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora(lora_scale=scale)
        pipe.unload_lora_weights()
    return pipe


def assert_same(model, want: dict[str, torch.Tensor]) -> None:
    """`model`'s state dict is `want`, bit for bit."""
    got = model.state_dict()
    assert set(got) == set(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def assert_lora_changes_image_and_replays(tmp_path: Path, args: list[str], out: Path) -> None:
    """`out`, made by `flux-gen` with `args` and a LoRA, differs from the image of `args` alone, and `--replay`
    makes it again bit for bit."""
    from click.testing import CliRunner
    from PIL import Image

    from flux_runtime.cli.gen import main

    plain = tmp_path / "plain.png"
    assert CliRunner().invoke(main, [*args, "-o", str(plain)]).exit_code == 0
    assert Image.open(out).tobytes() != Image.open(plain).tobytes()
    again = tmp_path / "again.png"
    res = CliRunner().invoke(main, ["--replay", str(out), "-o", str(again), "--quiet", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert Image.open(again).tobytes() == Image.open(out).tobytes()
