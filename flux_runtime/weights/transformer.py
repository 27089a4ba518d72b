"""`load_transformer`: a FLUX.1 DiT from a BFL file, a diffusers folder, or a cached model id.

The layout is read from the keys present, never from file names. The model is built on the meta
device and each tensor is streamed straight to the target device and dtype; the match against the
model is strict (missing, unexpected and misshapen keys are named).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import nn

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux1Transformer, Flux2Transformer
from flux_runtime.weights import flux1_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.checks import FiniteCheck, check_device, check_load_dtype, check_weight_dtypes
from flux_runtime.weights.config_files import INT_LIST, NUMBER, check_fields, read_json_if_present
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
# The fields of a diffusers transformer config.json the loaders read (the rest comes from the tensor shapes).
CONFIG_FIELDS = {"axes_dims_rope": INT_LIST, "rope_theta": NUMBER}


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
    where: Path | str = "checkpoint",
    axes_dim: tuple[int, ...] | None = None,
) -> DiTConfig:
    """Read depth, width, heads, channels and guidance from the checkpoint itself (`where` names it in errors).

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
    hidden, in_ch = need_shape(shape_of, img_in, "hidden size", 2)
    head_dim = need_shape(shape_of, qnorm, "head dim", 1)[0]
    if layout == "bfl" and depth == 0:
        mlp_hidden = need_shape(shape_of, "single_blocks.0.linear1.weight", "MLP width", 2)[0] - 3 * hidden
    else:
        mlp_hidden = need_shape(shape_of, mlp_in, "MLP width", 2)[0]
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes = axes_dim if axes_dim and sum(axes_dim) == head_dim else _axes_dim(head_dim, folder_config)
    with config_errors(where):
        cfg = DiTConfig(
            in_channels=in_ch,
            out_channels=need_shape(shape_of, final, "output channels", 2)[0],
            vec_in_dim=need_shape(shape_of, vec_in, "pooled text width", 2)[1],
            context_in_dim=need_shape(shape_of, txt_in, "text width", 2)[1],
            hidden_size=hidden,
            mlp_ratio=mlp_hidden / hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=depth_single,
            axes_dim=axes,
            guidance_embed=guidance,
        )
    return cfg


@contextmanager
def config_errors(where: Path | str) -> Iterator[None]:
    """Turn `DiTConfig`'s ValueError (shapes or config.json values no FLUX model has) into a WeightsError naming `where`."""
    try:
        yield
    except WeightsError:
        raise
    except ValueError as e:
        raise WeightsError(
            f"{where}: the checkpoint's shapes and config.json give no valid model ({e})"
        ) from None


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


def read_folder_config(files: list[Path]) -> dict | None:
    """The diffusers `config.json` beside a transformer's files, its fields that we read type-checked; or None."""
    path = files[0].parent / "config.json"
    cfg = read_json_if_present(path)
    if cfg is not None:
        check_fields(cfg, CONFIG_FIELDS, path)
    return cfg


def load_transformer(
    path_or_id: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux1Transformer | Flux2Transformer:
    """Load a FLUX.1 or FLUX.2 transformer, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL single file (`flux1-dev.safetensors`, optionally with the
    `model.diffusion_model.` prefix), a diffusers `transformer/` folder or pipeline root (sharded or
    not), a Hugging Face model id in the local cache, or a built-in model: `tiny` (trained, its shipped BFL
    file) or `tiny-random` (seeded random weights of the `TINY` preset). `config` is optional; when given it
    must agree with the checkpoint.
    FLUX.2 checkpoints (and `tiny-flux2`) load through `load_flux2_transformer`; `.config.family` says which.

    FP8 checkpoints (ModelOpt, ComfyUI scaled FP8, plain e4m3 casts) load as they are, their block
    projections kept in e4m3; `fp8=True` quantizes a bf16 checkpoint's block projections at load
    (per-channel weight scales, per-row activation scales). `.precision` says which (`bf16`,
    `fp8-static`, `fp8-dynamic`). FP8 models compute in bf16 between their FP8 GEMMs.
    `dtype` must be a floating-point dtype and `device` cpu, cuda, cuda:N or mps. Weights stored as integers
    or bools, and weights holding NaN or infinity, are refused by name.
    """
    device = check_device(device)
    dtype = check_load_dtype(dtype)
    fp8_layers.check_dtype(dtype, fp8)
    # FLUX.2 detect step: told apart by its keys. Its loader builds on this module's helpers, so it is
    # imported here (a top-level import would be circular).
    from flux_runtime.weights import flux2_transformer

    if flux2_transformer.is_flux2(path_or_id):
        return flux2_transformer.load_flux2_transformer(
            path_or_id, device=device, dtype=dtype, config=config, fp8=fp8
        )

    spec = builtin(path_or_id)
    if spec is not None and not spec.trained:
        with torch.device("meta"):
            model = Flux1Transformer(config or spec.dit)
        return finish_builtin(init_random(model, 0, device, dtype), dtype, fp8)
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
        read_folder_config(files),
        files[0],
        config.axes_dim if config is not None and config.family == "flux1" else None,
    )
    if config is not None:
        _check_config(inferred, config)
        inferred = replace(inferred, axes_dim=config.axes_dim, theta=config.theta)
    log.info("loading %s-layout FLUX.1 transformer from %s (%d files)", layout, files[0].parent, len(files))

    with torch.device("meta"):
        model = Flux1Transformer(inferred)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    reader = view if layout == "bfl" else src
    fp8_src = fp8_layers.Fp8Source.detect(reader, read_folder_config(files), str(files[0].parent))
    extra = fp8_src.extra_keys() if fp8_src is not None else set()

    finite = FiniteCheck()
    if layout == "bfl":
        _check_keys(set(keys) - extra, expected, shape_of)
        check_weight_dtypes(view, expected)
        table, assemble = identity_rules(expected), take_only
    else:
        cfg = inferred
        table = list(flux1_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed))
        used = {d for r in table for d in r.diffusers}
        missing = sorted(d for d in used if d not in src)
        unexpected = sorted(set(keys) - used - extra)
        raise_key_errors(missing, unexpected)
        assemble = flux1_layout.diffusers_to_bfl
        for rule in table:
            # expected diffusers shapes: split an empty tensor of the BFL shape the way the layout does
            meta = torch.empty(expected[rule.bfl], device="meta")
            for d, part in flux1_layout.bfl_to_diffusers(rule, meta, cfg.hidden_size).items():
                if src.shape(d) != tuple(part.shape):
                    raise WeightsError(
                        f"{d}: expected shape {tuple(part.shape)}, checkpoint has {src.shape(d)} (part of {rule.bfl})"
                    )
        check_weight_dtypes(src, sorted(used))
    read = finite.reader(lambda k: reader.get(k, device, dtype), reader.path_of)
    model.precision = fp8_layers.load_state(
        model, table, lambda k, _device, _dtype: read(k), assemble,
        device=device, dtype=dtype, fp8=fp8_src, quantize=fp8,
    )  # fmt: skip
    finite.raise_if_any()
    model.quantized_at_load = fp8
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def identity_rules(expected: dict[str, tuple[int, ...]]) -> list[flux1_layout.Rule]:
    """Rules for a checkpoint stored under our own (BFL) names: each key is itself."""
    return [flux1_layout.Rule(k, (k,)) for k in expected]


def take_only(rule: flux1_layout.Rule, get) -> torch.Tensor:
    """`assemble` for identity rules."""
    return get(rule.diffusers[0])


def finish_builtin(model: nn.Module, dtype: torch.dtype, fp8: bool) -> nn.Module:
    """A built-in random model, quantized when `fp8`, with its precision recorded."""
    model.precision = fp8_layers.quantize_model(model, dtype) if fp8 else fp8_layers.precision_of({}, dtype)
    model.quantized_at_load = fp8
    return model.eval()


def _check_keys(keys: set[str], expected: dict[str, tuple[int, ...]], shape_of) -> None:
    raise_key_errors(sorted(set(expected) - keys), sorted(keys - set(expected)))
    for k, want in expected.items():
        got = tuple(shape_of(k))
        if got != want:
            raise WeightsError(f"{k}: expected shape {want}, checkpoint has {got}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
