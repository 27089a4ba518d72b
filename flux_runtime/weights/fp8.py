"""FP8 transformers: e4m3 weights and their scales in a checkpoint, merged shards, quantization at load.

Formats, each told from its keys and dtypes (never from a file name):

- ModelOpt FP8 (diffusers names): per quantized Linear `P.weight` e4m3 (out, in), `P.weight_scale` and
  `P.input_scale` fp32 of shape `[]` or `[1]`; `config.json` carries `quantization_config`
  (`quant_method: modelopt`, `quant_algo: FP8`, `ignore` globs of the layers kept in bf16).
- ComfyUI scaled FP8 (BFL names): `X.weight` e4m3 with `X.scale_weight` (and `X.scale_input`), or the
  newer `X.weight_scale` / `X.input_scale` with `X.comfy_quant`; a `scaled_fp8` marker tensor.
- Plain e4m3 casts (BFL names, no scales at all): weight scale 1, activations scaled per row at run time.

Our FLUX.1 / FLUX.2 modules fuse q/k/v (and the single block's MLP input) into one weight. FP8 shards are concatenated
byte for byte and each keeps its weight scale as rows of a per-output-channel vector, so merging
rounds nothing; the shards read one activation, so they need one `input_scale` (equal in calibrated
checkpoints; if not, the largest is taken and a warning says so).

Quantization at load (`fp8=True`) turns a bf16 checkpoint's block projections into e4m3 with one scale
per output channel (`amax / 448`) and per-row activation scales; embedders, modulation and the final
layer stay in bf16, as the published FP8 recipes keep them.

FLUX.3 follows the FLUX.2 recipe. In FP8: `q_proj`, `k_proj`, `v_proj`, `attn_out`, `mlp_in` and `mlp_out`
of every per-mode block (`txt_mode_blocks.N`, `content_mode_blocks.{image,image_cond}.N`) and every joint
block (`single_blocks.N`): by count, 98% of the GEMM FLOPs of a 1024² step with 480 text tokens
(13 D² per token per block, against ~8 D² per image token and ~13 D² per text token outside them). Kept in
bf16, and why:
- the embedders (`emb_in.*`, `txt_in`, `time_in`, `ref_time_in`): they read the raw inputs (latents, the
  stacked Qwen3-VL states, whose few outlier channels LLMs are known for, sinusoids), where one scale per
  token set by the largest channel leaves the small ones few e4m3 steps; they are a small share of the work;
- the modulation layers (`*_stream_modulations.*`): their shift, scale and gate multiply every token of
  the residual stream in every block, so their error is amplified rather than averaged out;
- the final layer (`final_layer.image.*`): it writes the predicted velocity itself.
FLUX.3 keeps q, k and v apart in both layouts, so nothing is merged: each FP8 layer has its own scales.
The fp32 QK-norm weights are not projections and stay fp32.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flux_runtime.kernels.fp8 import E4M3, E4M3_MAX, MIN_AMAX, check_fp8_gemm
from flux_runtime.models.dit.layers import Fp8Linear, Linear
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import Rule

log = logging.getLogger(__name__)

E4M3_HEADER = "F8_E4M3"
_WEIGHT_SCALE = (".weight_scale", ".scale_weight")
_INPUT_SCALE = (".input_scale", ".scale_input")
_IGNORED_SUFFIXES = (".comfy_quant", "_amax", ".weight_amax", ".input_amax")
_MARKERS = ("scaled_fp8",)
# BFL module names of the projections that run in FP8 (the rest stay in the activations' dtype):
# FLUX.1 / FLUX.2 double-block qkv, proj and MLP, single-block linear1 / linear2; FLUX.3 (see above)
# the attention and SwiGLU projections of every per-mode and joint block
_FP8_MODULES = re.compile(
    r"(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.(0|2))|single_blocks\.\d+\.linear(1|2)"
    r"|(txt_mode_blocks|content_mode_blocks\.(image|image_cond)|single_blocks)\.\d+\."
    r"(q_proj|k_proj|v_proj|attn_out|mlp_in|mlp_out))$"
)
QUANTIZE_COMMAND = "flux-convert quantize SRC DST"


@dataclass(frozen=True)
class Fp8Tensors:
    """One e4m3 projection as it goes into `Fp8Linear`."""

    weight: Tensor  # (out, in) e4m3
    weight_scale: Tensor  # () per tensor or (out,) per output channel, fp32
    input_scale: Tensor | None  # () fp32, or None for per-row activation scales


class TensorReader:
    """What the FP8 reader needs of a checkpoint view: keys, header dtypes, raw tensors."""

    def keys(self) -> list[str]: ...
    def dtype(self, key: str) -> str: ...
    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> Tensor: ...


def check_dtype(dtype: torch.dtype, fp8: bool) -> None:
    """FP8 models compute in bf16 between their GEMMs; refuse `fp8=True` with another dtype up front."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise WeightsError(
            f"dtype {dtype} is not a model dtype; use torch.bfloat16, torch.float16 or torch.float32"
        )
    if fp8 and dtype != torch.bfloat16:
        raise WeightsError(
            f"fp8=True computes in bf16 between the FP8 GEMMs; pass dtype=torch.bfloat16, not {dtype}"
        )


def may_run_fp8(module: str) -> bool:
    """True for the block projections that FP8 checkpoints quantize and that quantization at load converts."""
    return _FP8_MODULES.search(module) is not None


class Fp8Source:
    """The FP8 side of one checkpoint: which weights are e4m3 and the scales that go with them."""

    def __init__(self, src: TensorReader, kind: str, name: str) -> None:
        self.src, self.kind, self.name = src, kind, name
        self._keys = set(src.keys())
        self._warned_input = False

    @classmethod
    def detect(cls, src: TensorReader, folder_config: dict | None, name: str) -> Fp8Source | None:
        """The checkpoint's FP8 format, or None for a plain bf16/fp16/fp32 one.

        Raises for a folder that declares ModelOpt FP8 but holds no e4m3 weights (a raw export).
        """
        keys = src.keys()
        fp8_weights = [k for k in keys if k.endswith(".weight") and src.dtype(k) == E4M3_HEADER]
        has_scales = any(k.endswith(_WEIGHT_SCALE) for k in keys)
        qcfg = (folder_config or {}).get("quantization_config")
        declared = (
            isinstance(qcfg, dict)
            and "fp8" in str(qcfg.get("quant_algo", qcfg.get("quant_type", ""))).lower()
        )
        if declared and not fp8_weights:
            raise WeightsError(
                f"{name}: config.json declares ModelOpt FP8, but the weights are not e4m3 and carry no scales "
                f"(a raw ModelOpt export); write a loadable FP8 checkpoint with `{QUANTIZE_COMMAND}`"
            )
        if not fp8_weights:
            return None
        kind = "modelopt" if declared else ("scaled" if has_scales else "cast")
        found = cls(src, kind, name)
        if declared:
            found._check_ignore(qcfg.get("ignore") or [])
        log.info("%s: %d e4m3 weights (%s FP8)", name, len(fp8_weights), kind)
        return found

    def extra_keys(self) -> set[str]:
        """Keys that are not model tensors of their own: scales, markers, calibration leftovers."""
        suffixes = _WEIGHT_SCALE + _INPUT_SCALE + _IGNORED_SUFFIXES
        return {k for k in self._keys if k.endswith(suffixes) or k in _MARKERS}

    def is_fp8(self, weight_keys: tuple[str, ...]) -> bool:
        """True when every shard is e4m3; a mix of e4m3 and other shards is an error."""
        fp8 = [self.src.dtype(k) == E4M3_HEADER for k in weight_keys]
        if any(fp8) and not all(fp8):
            raise WeightsError(
                f"{self.name}: {', '.join(weight_keys)} are merged into one layer but only some are FP8"
            )
        return all(fp8)

    def read(self, weight_keys: tuple[str, ...], swap_halves: bool, device: torch.device) -> Fp8Tensors:
        """The e4m3 weight of one of our layers from its shards, scales per output channel where they differ."""
        weights, w_scales, i_scales = [], [], []
        for k in weight_keys:
            w = self.src.get(k, device)
            weights.append(w)
            w_scales.append(self._weight_scale(k, w.shape[0], device))
            i_scales.append(self._scale(k, _INPUT_SCALE, device, required=False))
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        if all(s.ndim == 0 for s in w_scales) and all(torch.equal(s, w_scales[0]) for s in w_scales):
            w_scale = w_scales[0]
        else:
            w_scale = torch.cat([s.expand(w.shape[0]) for s, w in zip(w_scales, weights, strict=True)])
        if swap_halves:
            weight = torch.cat(weight.chunk(2, dim=0)[::-1])
            if w_scale.ndim:
                w_scale = torch.cat(w_scale.chunk(2, dim=0)[::-1])
        return Fp8Tensors(weight, w_scale, self._merge_input_scales(weight_keys, i_scales))

    # ----------------------------------------------------------------------------------------------

    def _weight_scale(self, weight_key: str, rows: int, device: torch.device) -> Tensor:
        s = self._scale(weight_key, _WEIGHT_SCALE, device, required=self.kind != "cast")
        if s is None:
            return torch.ones((), dtype=torch.float32, device=device)
        if s.ndim == 1 and s.numel() == rows and rows > 1:
            return s
        if s.numel() != 1:
            raise WeightsError(
                f"{self.name}: {self._scale_key(weight_key, _WEIGHT_SCALE)} has shape {tuple(s.shape)}; "
                f"expected [] or [1] (per tensor) or [{rows}] (per output channel)"
            )
        return s.reshape(())

    def _scale_key(self, weight_key: str, suffixes: tuple[str, ...]) -> str:
        base = weight_key[: -len(".weight")]
        for suffix in suffixes:
            if base + suffix in self._keys:
                return base + suffix
        return base + suffixes[0]

    def _scale(
        self, weight_key: str, suffixes: tuple[str, ...], device: torch.device, *, required: bool
    ) -> Tensor | None:
        key = self._scale_key(weight_key, suffixes)
        if key not in self._keys:
            if required:
                raise WeightsError(f"{self.name}: {weight_key} is FP8 but has no scale ({key} is missing)")
            return None
        s = self.src.get(key, device).to(torch.float32)
        if suffixes == _INPUT_SCALE and s.numel() != 1:
            raise WeightsError(f"{self.name}: {key} has shape {tuple(s.shape)}; expected [] or [1]")
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise WeightsError(
                f"{self.name}: {key} must be finite and positive, got {s.flatten()[:4].tolist()}"
            )
        return s.reshape(()) if s.numel() == 1 else s.reshape(-1)

    def _merge_input_scales(self, keys: tuple[str, ...], scales: list[Tensor | None]) -> Tensor | None:
        if all(s is None for s in scales):
            return None
        if any(s is None for s in scales):
            raise WeightsError(
                f"{self.name}: of the merged shards {', '.join(keys)} only some have an input scale"
            )
        first = scales[0]
        assert first is not None
        if all(torch.equal(s, first) for s in scales):  # type: ignore[arg-type]
            return first
        merged = torch.stack(scales).amax()  # type: ignore[arg-type]
        if not self._warned_input:
            self._warned_input = True
            log.warning(
                "%s: merged FP8 shards have different input scales (e.g. %s); using the largest for each merged layer",
                self.name,
                ", ".join(f"{float(s):.4g}" for s in scales),  # type: ignore[arg-type]
            )
        return merged

    def _check_ignore(self, globs: Iterable[str]) -> None:
        modules = {k.rsplit(".", 1)[0] for k in self._keys}
        for pattern in globs:
            if not isinstance(pattern, str):
                raise WeightsError(
                    f"{self.name}: quantization_config.ignore holds {pattern!r}, not a glob string"
                )
            heads = {m.split(".", 1)[0] for m in modules}
            if not any(fnmatch.fnmatchcase(m, pattern) for m in modules | heads):
                log.warning("%s: quantization_config.ignore entry %r matches no layer", self.name, pattern)


# --------------------------------------------------------------------------------------------------
# quantization at load


@torch.no_grad()
def quantize_weight(w: Tensor) -> Fp8Tensors:
    """e4m3 of a bf16 weight (out, in) with one scale per output channel, `amax / 448` (dynamic activations).

    Without grad: from a Parameter the result would carry an autograd graph whose saved tensors (the bf16
    weight, its abs, two fp32 copies: 11 bytes per weight) live as long as the e4m3 weight does."""
    amax = w.abs().amax(dim=1).float()
    scale = amax.clamp(min=MIN_AMAX) / E4M3_MAX
    q = (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Tensors(q, scale, None)


def dequantize(t: Fp8Tensors, dtype: torch.dtype) -> Tensor:
    """The weight an e4m3 projection stands for, in `dtype` (for layers or GPUs that do not run FP8)."""
    scale = t.weight_scale if t.weight_scale.ndim == 0 else t.weight_scale[:, None]
    return (t.weight.float() * scale).to(dtype)


# --------------------------------------------------------------------------------------------------
# filling a model


def precision_of(layers: dict[str, Fp8Tensors], dtype: torch.dtype) -> str:
    """`bf16`/`fp16`/`fp32`, or `fp8-static` / `fp8-dynamic` (both when layers differ)."""
    if not layers:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    kinds = sorted({"static" if t.input_scale is not None else "dynamic" for t in layers.values()})
    return "fp8-" + "+".join(kinds)


def load_state(
    model: nn.Module,
    rules: list[Rule],
    read: Callable[[str], Tensor],
    assemble: Callable[[Rule, Callable[[str], Tensor]], Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    fp8: Fp8Source | None,
    quantize: bool,
) -> str:
    """Stream every rule's tensor into `model` (built on meta) and return its precision.

    `read(key)` gives one checkpoint tensor already on `device` in `dtype` (FP8 weights are read raw here).

    FP8 weights of block projections go into `Fp8Linear` modules as they are; FP8 weights anywhere else,
    or on a device without FP8 GEMMs, are dequantized to `dtype` (said once). With `quantize`, bf16 block
    projections are quantized as they stream in, so the bf16 copy of the model never exists at once.
    """
    if fp8 is not None and dtype != torch.bfloat16:
        raise WeightsError(
            f"{fp8.name}: an FP8 checkpoint computes in bf16 between its GEMMs; pass dtype=torch.bfloat16"
        )
    sd: dict[str, Tensor] = {}
    layers: dict[str, Fp8Tensors] = {}
    no_fp8 = check_fp8_gemm(device)
    if quantize and no_fp8 is not None:
        raise WeightsError(f"fp8=True: {no_fp8}; load the model without fp8")
    dequantized: list[str] = []
    for rule in rules:
        module, _, leaf = rule.bfl.rpartition(".")
        if leaf == "weight" and fp8 is not None and fp8.is_fp8(rule.diffusers):
            t = fp8.read(rule.diffusers, rule.swap_halves, device)
            if may_run_fp8(module) and no_fp8 is None:
                layers[module] = t
            else:
                sd[rule.bfl] = dequantize(t, dtype)
                dequantized.append(module)
            continue
        tensor = assemble(rule, read)
        if leaf == "weight" and quantize and may_run_fp8(module):
            layers[module] = quantize_weight(tensor)
            del tensor
            continue
        sd[rule.bfl] = tensor
    if dequantized:
        why = no_fp8 or "these layers run in the activations' dtype"
        log.warning(
            "%d FP8 weights dequantized to %s (%s), e.g. %s", len(dequantized), dtype, why, dequantized[0]
        )
    _install(model, layers, sd, dtype)
    model.load_state_dict(sd, strict=True, assign=True)
    return precision_of(layers, dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, dtype: torch.dtype, under: str = "") -> str:
    """Quantize a loaded model's block projections in place, one layer at a time; returns its precision.

    `under` ("single_blocks.3."): only the projections whose names start with it, so a model can be
    filled and quantized block by block (the rest may still be on meta)."""
    # names only: a list of the modules themselves would keep every bf16 weight alive to the end
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, Linear) and may_run_fp8(n) and n.startswith(under)
    ]
    device = model.get_submodule(names[0]).weight.device if names else next(model.parameters()).device
    reason = check_fp8_gemm(device)
    if reason is not None:
        raise WeightsError(f"fp8=True: {reason}; load the model without fp8")
    done: dict[str, Fp8Tensors] = {}
    for name in names:
        module = model.get_submodule(name)
        t = quantize_weight(module.weight)
        sd: dict[str, Tensor] = {}
        _install(model, {name: t}, sd, dtype)  # the bf16 module is dropped here
        new = model.get_submodule(name)
        new.weight, new.weight_scale = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
        new.bias = None if module.bias is None else nn.Parameter(module.bias.detach(), requires_grad=False)
        done[name] = Fp8Tensors(t.weight, t.weight_scale, None)
        del module, t
    return precision_of(done, dtype)


def static_input_scale(amax: float) -> Tensor:
    """The static input scale of a projection whose inputs reached `amax` in calibration ("max" calibration, as
    ModelOpt's): `max(amax, MIN_AMAX) / 448`, fp32, 0-dim."""
    return torch.tensor(max(amax, MIN_AMAX) / E4M3_MAX, dtype=torch.float32)


def set_static_input_scales(model: nn.Module, ranges: Mapping[str, float]) -> int:
    """Give each FP8 projection of `model` that scales its input per row, and that `ranges` names (its calibrated
    max |input|, `fp8_export.record_input_ranges`), the static input scale of that range instead: the producers
    before it then write e4m3 at once, with no pass over the row for its absmax. The weights stay as they are.
    An approximation of its own (a range seen in calibration, not each row's): returns how many changed, and
    `model.precision` (what the provenance records) says the layers' kinds afterwards."""
    changed = 0
    kinds = set()
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        if module.input_scale is None and name in ranges:
            scale = static_input_scale(ranges[name]).to(module.weight.device)
            del module.input_scale, module.input_scale_inv  # plain None attributes of a per-row layer
            module.register_buffer("input_scale", scale)
            module.register_buffer("input_scale_inv", scale.reciprocal())
            changed += 1
        kinds.add("static" if module.input_scale is not None else "dynamic")
    if kinds:
        model.precision = "fp8-" + "+".join(sorted(kinds))
    return changed


def _install(
    model: nn.Module, layers: dict[str, Fp8Tensors], sd: dict[str, Tensor], dtype: torch.dtype
) -> None:
    """Swap each named `Linear` for an `Fp8Linear` on meta and add its tensors to `sd`."""
    for module, t in layers.items():
        old = model.get_submodule(module)
        if not isinstance(old, Linear):
            raise WeightsError(f"{module} is not a projection; it cannot hold an FP8 weight")
        if tuple(t.weight.shape) != (old.out_features, old.in_features):
            raise WeightsError(
                f"{module}.weight: expected shape {(old.out_features, old.in_features)}, checkpoint has {tuple(t.weight.shape)}"
            )
        with torch.device("meta"):
            new = Fp8Linear(
                old.in_features, old.out_features, old.bias is not None,
                per_channel=t.weight_scale.ndim == 1, static=t.input_scale is not None, dtype=dtype,
            )  # fmt: skip
        parent, _, child = module.rpartition(".")
        model.get_submodule(parent).register_module(child, new)
        sd[f"{module}.weight"] = t.weight
        sd[f"{module}.weight_scale"] = t.weight_scale
        if t.input_scale is not None:
            sd[f"{module}.input_scale"] = t.input_scale
            sd[f"{module}.input_scale_inv"] = t.input_scale.reciprocal()
