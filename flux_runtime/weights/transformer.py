"""`load_transformer`: a FLUX.1 DiT from a BFL file, a diffusers folder, or a cached model id.

The layout is read from the keys present, never from file names. The model is built on the meta
device and each tensor is streamed straight to the target device and dtype; the match against the
model is strict (missing, unexpected and misshapen keys are named).
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import nn

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux1Transformer, Flux2Transformer
from flux_runtime.weights import flux1_layout
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve, safetensors_files
from flux_runtime.weights.keys import KeyView, need_shape, raise_key_errors, strip_prefix
from flux_runtime.weights.random_init import init_random
from flux_runtime.weights.safetensors_io import TensorSource, read_header

log = logging.getLogger(__name__)

_BFL_MARK = "double_blocks.0.img_attn.norm.key_norm.scale"
_BFL_ANY = ("img_in.weight", "final_layer.linear.weight")
_DIFFUSERS_ANY = ("x_embedder.weight", "proj_out.weight")
# Random-weight presets that need no checkpoint (the offline demo and tests).


def find_transformer_files(path: Path) -> list[Path]:
    """The safetensors files holding the transformer under `path` (file, component or pipeline folder)."""
    if path.is_file():
        return [path]
    if (path / "transformer").is_dir():
        return find_transformer_files(path / "transformer")
    files = safetensors_files(path, "diffusion_pytorch_model")
    if files:
        return files
    # A BFL repo root: the transformer is the single file whose keys look like a FLUX DiT.
    for f in sorted(path.glob("*.safetensors")):
        keys = read_header(f)
        if any(_strip(k) in (*_BFL_ANY, _BFL_MARK) for k in keys):
            return [f]
    raise WeightsError(
        f"{path}: no FLUX transformer found (no transformer/ folder, no diffusion_pytorch_model*.safetensors, no BFL single file)"
    )


def _strip(key: str) -> str:
    return strip_prefix(key, flux1_layout.BFL_PREFIXES)


def detect_layout(keys: list[str]) -> str:
    """'bfl' or 'diffusers', from the keys present."""
    stripped = {_strip(k) for k in keys}
    if any(k in stripped for k in (*_BFL_ANY, _BFL_MARK)):
        return "bfl"
    if any(k in keys for k in _DIFFUSERS_ANY):
        return "diffusers"
    sample = ", ".join(sorted(keys)[:5]) or "no keys at all"
    raise WeightsError(
        f"unknown checkpoint layout: not a FLUX.1 transformer in BFL or diffusers form (keys: {sample}, ...)"
    )


def infer_config(
    layout: str,
    keys: list[str],
    shape_of,
    folder_config: dict | None,
    axes_dim: tuple[int, ...] | None = None,
) -> DiTConfig:
    """Read depth, width, heads, channels and guidance from the checkpoint itself.

    The RoPE axes are not in the weights: `axes_dim` (a caller's config), else the folder's config.json,
    else the preset with this head dim.
    """
    if layout == "diffusers":
        img_in, txt_in, vec_in = (
            "x_embedder.weight",
            "context_embedder.weight",
            "time_text_embed.text_embedder.linear_1.weight",
        )
        qnorm, mlp_in, final = (
            "transformer_blocks.0.attn.norm_q.weight",
            "transformer_blocks.0.ff.net.0.proj.weight",
            "proj_out.weight",
        )
        depth = flux1_layout.count_blocks(keys, "transformer_blocks")
        depth_single = flux1_layout.count_blocks(keys, "single_transformer_blocks")
        guidance = any(k.startswith("time_text_embed.guidance_embedder.") for k in keys)
        if depth == 0:
            qnorm = "single_transformer_blocks.0.attn.norm_q.weight"
            mlp_in = "single_transformer_blocks.0.proj_mlp.weight"
    else:
        img_in, txt_in, vec_in = "img_in.weight", "txt_in.weight", "vector_in.in_layer.weight"
        qnorm, mlp_in, final = (
            "double_blocks.0.img_attn.norm.query_norm.scale",
            "double_blocks.0.img_mlp.0.weight",
            "final_layer.linear.weight",
        )
        depth = flux1_layout.count_blocks(keys, "double_blocks")
        depth_single = flux1_layout.count_blocks(keys, "single_blocks")
        guidance = any(k.startswith("guidance_in.") for k in keys)
        if depth == 0:
            qnorm = "single_blocks.0.norm.query_norm.scale"
    hidden, in_ch = need_shape(shape_of, img_in, "hidden size")
    head_dim = need_shape(shape_of, qnorm, "head dim")[0]
    if layout == "bfl" and depth == 0:
        mlp_hidden = need_shape(shape_of, "single_blocks.0.linear1.weight", "MLP width")[0] - 3 * hidden
    else:
        mlp_hidden = need_shape(shape_of, mlp_in, "MLP width")[0]
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes = axes_dim if axes_dim and sum(axes_dim) == head_dim else _axes_dim(head_dim, folder_config)
    return DiTConfig(
        in_channels=in_ch,
        out_channels=need_shape(shape_of, final, "output channels")[0],
        vec_in_dim=need_shape(shape_of, vec_in, "pooled text width")[1],
        context_in_dim=need_shape(shape_of, txt_in, "text width")[1],
        hidden_size=hidden,
        mlp_ratio=mlp_hidden / hidden,
        num_heads=hidden // head_dim,
        depth=depth,
        depth_single_blocks=depth_single,
        axes_dim=axes,
        guidance_embed=guidance,
    )


def _axes_dim(head_dim: int, folder_config: dict | None) -> tuple[int, ...]:
    if folder_config and "axes_dims_rope" in folder_config:
        return tuple(folder_config["axes_dims_rope"])
    for preset in PRESETS.values():
        if preset.head_dim == head_dim:
            return preset.axes_dim
    raise WeightsError(f"cannot tell the RoPE axes for head dim {head_dim}; pass config= with axes_dim")


def _check_config(inferred: DiTConfig, given: DiTConfig) -> None:
    diffs = [
        f"{f.name}: checkpoint {getattr(inferred, f.name)}, config {getattr(given, f.name)}"
        for f in fields(DiTConfig)
        if f.name not in ("axes_dim", "theta") and getattr(inferred, f.name) != getattr(given, f.name)
    ]
    if diffs:
        raise WeightsError("checkpoint does not match the given config: " + "; ".join(diffs))


def _folder_config(files: list[Path]) -> dict | None:
    cfg = files[0].parent / "config.json"
    if cfg.is_file():
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise WeightsError(f"{cfg}: not valid JSON ({e})") from None
    return None


def load_transformer(
    path_or_id: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
) -> Flux1Transformer | Flux2Transformer:
    """Load a FLUX.1 or FLUX.2 transformer, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL single file (`flux1-dev.safetensors`, optionally with the
    `model.diffusion_model.` prefix), a diffusers `transformer/` folder or pipeline root (sharded or
    not), a Hugging Face model id in the local cache, or a built-in model: `tiny` (trained, its shipped BFL
    file) or `tiny-random` (seeded random weights of the `TINY` preset). `config` is optional; when given it
    must agree with the checkpoint.
    FLUX.2 checkpoints (and `tiny-flux2`) load through `load_flux2_transformer`; `.config.family` says which.
    """
    device = torch.device(device)
    # FLUX.2 detect step: told apart by its keys. Its loader builds on this module's helpers, so it is
    # imported here (a top-level import would be circular).
    from flux_runtime.weights import flux2_transformer

    if flux2_transformer.is_flux2(path_or_id):
        return flux2_transformer.load_flux2_transformer(path_or_id, device=device, dtype=dtype, config=config)

    spec = builtin(path_or_id)
    if spec is not None and not spec.trained:
        with torch.device("meta"):
            model = Flux1Transformer(config or spec.dit)
        return init_random(model, 0, device, dtype).eval()
    if spec is not None:
        path_or_id, config = spec.transformer_path, config or spec.dit

    files = find_transformer_files(resolve(path_or_id))
    src = TensorSource(files)
    layout = detect_layout(src.keys())
    if layout == "bfl":
        view = KeyView(src, flux1_layout.BFL_PREFIXES)
        keys, shape_of = view.keys(), view.shape
    else:
        keys, shape_of = src.keys(), src.shape
    inferred = infer_config(
        layout,
        keys,
        shape_of,
        _folder_config(files),
        config.axes_dim if config is not None and config.family == "flux1" else None,
    )
    if config is not None:
        _check_config(inferred, config)
        inferred = replace(inferred, axes_dim=config.axes_dim, theta=config.theta)
    log.info("loading %s-layout FLUX.1 transformer from %s (%d files)", layout, files[0].parent, len(files))

    with torch.device("meta"):
        model = Flux1Transformer(inferred)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    if layout == "bfl":
        _check_keys(set(keys), expected, shape_of)
        sd = {k: view.get(k, device, dtype) for k in expected}
    else:
        cfg = inferred
        table = list(flux1_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed))
        used = {d for r in table for d in r.diffusers}
        missing = sorted(d for d in used if d not in src)
        unexpected = sorted(set(keys) - used)
        raise_key_errors(missing, unexpected)
        sd = {}
        for rule in table:
            # expected diffusers shapes: split an empty tensor of the BFL shape the way the layout does
            meta = torch.empty(expected[rule.bfl], device="meta")
            for d, part in flux1_layout.bfl_to_diffusers(rule, meta, cfg.hidden_size).items():
                if src.shape(d) != tuple(part.shape):
                    raise WeightsError(
                        f"{d}: expected shape {tuple(part.shape)}, checkpoint has {src.shape(d)} (part of {rule.bfl})"
                    )
        for rule in table:
            sd[rule.bfl] = flux1_layout.diffusers_to_bfl(rule, lambda k: src.get(k, device, dtype))
    model.load_state_dict(sd, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _check_keys(keys: set[str], expected: dict[str, tuple[int, ...]], shape_of) -> None:
    raise_key_errors(sorted(set(expected) - keys), sorted(keys - set(expected)))
    for k, want in expected.items():
        got = tuple(shape_of(k))
        if got != want:
            raise WeightsError(f"{k}: expected shape {want}, checkpoint has {got}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
