"""Writing a ModelOpt-format FP8 diffusers folder from a bf16 transformer and calibrated activation ranges.

The output is what NVIDIA ModelOpt's FP8 export holds, so our loader and other readers of that format take
it: diffusers key names; per quantized Linear an e4m3 `weight` with a per-tensor `weight_scale`
(`amax(|W|) / 448`) and a static `input_scale` (`amax(|x|) / 448` over the calibration runs), both fp32 of
shape `[]`; every other tensor as it was; `config.json` with a `quantization_config` (`quant_method:
modelopt`, `quant_algo: FP8`, the `ignore` globs of the layers left in bf16). q, k and v of one attention
read one input, so they get one input scale. FLUX.1, FLUX.2 and FLUX.3 (whose q, k, v are our modules too,
each calibrated on the same input, hence equal scales) alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

import flux_runtime
from flux_runtime.kernels.fp8 import E4M3, E4M3_MAX, MIN_AMAX
from flux_runtime.models.dit import DiTConfig
from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout
from flux_runtime.weights.convert_plan import ConversionPlan, Step
from flux_runtime.weights.convert_write import DEFAULT_MAX_SHARD_SIZE, write_diffusers
from flux_runtime.weights.diffusers_config import transformer_diffusers_config
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.fp8 import may_run_fp8, static_input_scale
from flux_runtime.weights.safetensors_writer import Output

# diffusers names of the layers FP8 exports keep in bf16 (embedders, modulation, final layer)
IGNORE = {
    "flux1": [
        "x_embedder",
        "context_embedder",
        "time_text_embed*",
        "*norm1*",
        "*norm.linear",
        "norm_out*",
        "proj_out",
    ],
    "flux2": [
        "x_embedder",
        "context_embedder",
        "time_guidance_embed*",
        "*modulation*",
        "norm_out*",
        "proj_out",
    ],
    "flux3": [
        "x_embedders*",
        "context_embedder",
        "*timestep_embedder*",
        "*modulations*",
        "norm_out*",
        "proj_out",
    ],
}


def record_input_ranges(model: nn.Module) -> tuple[dict[str, float], Callable[[], None]]:
    """Hook every block projection of `model` to keep the max |input| it sees; returns (ranges, remove)."""
    ranges: dict[str, float] = {}
    hooks = []
    wrapped = []

    def note(name: str, x: Tensor) -> None:
        ranges[name] = max(ranges.get(name, 0.0), float(x.detach().abs().amax()))

    for name, module in model.named_modules():
        if may_run_fp8(name) and hasattr(module, "weight") and module.weight.ndim == 2:
            hooks.append(module.register_forward_pre_hook(lambda _m, args, name=name: note(name, args[0])))
            # merged projections are also called through `split`, which is not `forward`
            split = module.split

            def recording_split(x: Tensor, *args, name: str = name, split=split, **kw):  # type: ignore[no-untyped-def]
                note(name, x)
                return split(x, *args, **kw)

            module.split = recording_split
            wrapped.append(module)

    def remove() -> None:
        for h in hooks:
            h.remove()
        for module in wrapped:
            del module.split

    return ranges, remove


def quantize_per_tensor(w: Tensor) -> tuple[Tensor, Tensor]:
    """`w` in e4m3 with one fp32 scale (`amax / 448`), as a ModelOpt checkpoint stores a weight."""
    scale = (w.abs().amax().float().clamp(min=MIN_AMAX) / E4M3_MAX).reshape(())
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def write_modelopt_fp8(
    model: nn.Module,
    ranges: dict[str, float],
    dst: Path,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> list[Path]:
    """Write `model` (bf16, ours) as a ModelOpt FP8 diffusers folder, with `ranges` as the input amax per layer."""
    cfg = model.config
    table, split = _layout(cfg)
    sd = model.state_dict()
    missing = sorted(
        k.rsplit(".", 1)[0]
        for k in sd
        if k.endswith(".weight") and may_run_fp8(k.rsplit(".", 1)[0]) and k.rsplit(".", 1)[0] not in ranges
    )
    if missing:
        raise WeightsError(
            f"no calibration data for {len(missing)} layers (e.g. {missing[0]}); run at least one generation"
        )

    def tensors_of(rule: flux1_layout.Rule) -> dict[str, Tensor]:
        module, _, leaf = rule.bfl.rpartition(".")
        parts = split(rule, sd[rule.bfl])
        if leaf != "weight" or module not in ranges:
            return {k: v.contiguous().cpu() for k, v in parts.items()}
        s_in = static_input_scale(ranges[module])
        out = {}
        for key, w in parts.items():
            base = key.removesuffix(".weight")
            q, scale = quantize_per_tensor(w)
            out[key], out[f"{base}.weight_scale"], out[f"{base}.input_scale"] = (
                q.cpu(),
                scale.cpu(),
                s_in.clone(),
            )
        return out

    steps = []
    for rule in table:
        meta = _meta_outputs(rule, sd, split, ranges)
        steps.append(
            Step(
                tuple(Output(k, tuple(v.shape), v.dtype) for k, v in meta.items()),
                lambda r=rule: tensors_of(r),
            )
        )
    config = transformer_diffusers_config(cfg)
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            }
        },
        "ignore": IGNORE[cfg.family],
        "producer": {"name": "flux-runtime", "version": flux_runtime.__version__},
    }
    plan = ConversionPlan(
        component="transformer", source=[], source_layout="bfl", target_layout="diffusers",
        steps=steps, config=cfg, diffusers_config=config,
    )  # fmt: skip
    return write_diffusers(plan, dst, max_shard_size=max_shard_size, overwrite=overwrite)


def _layout(cfg: DiTConfig) -> tuple[list[flux1_layout.Rule], Callable[[flux1_layout.Rule, Tensor], dict]]:
    """The family's diffusers rule table for this model and its BFL → diffusers split."""
    if cfg.family == "flux1":
        rules = flux1_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed)
        return list(rules), lambda r, t: flux1_layout.bfl_to_diffusers(r, t, cfg.hidden_size)
    if cfg.family == "flux3":
        rules = flux3_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.flow_map)
        return list(rules), flux3_layout.bfl_to_diffusers
    rules = flux2_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed)
    return list(rules), flux2_layout.bfl_to_diffusers


def _meta_outputs(rule, sd, split, ranges) -> dict[str, Tensor]:
    """The tensors `tensors_of(rule)` will write, as meta tensors (shapes and dtypes only)."""
    module, _, leaf = rule.bfl.rpartition(".")
    parts = split(rule, torch.empty(sd[rule.bfl].shape, dtype=sd[rule.bfl].dtype, device="meta"))
    if leaf != "weight" or module not in ranges:
        return parts
    out = {}
    for key, w in parts.items():
        base = key.removesuffix(".weight")
        out[key] = torch.empty(w.shape, dtype=E4M3, device="meta")
        out[f"{base}.weight_scale"] = torch.empty((), dtype=torch.float32, device="meta")
        out[f"{base}.input_scale"] = torch.empty((), dtype=torch.float32, device="meta")
    return out
