"""Writing a FLUX.1, FLUX.2 or FLUX.3 transformer as one GGUF file (`flux-convert gguf`), as city96's files are.

The source is planned as any conversion is (`convert_plan.plan_transformer(..., to_bfl=True)`: a BFL file, a
diffusers folder or a cached id, every key and shape checked), its tensors under BFL names (no prefix). Each
tensor's GGML type is chosen from its name, shape and source dtype (`tensor_type`, the rule city96's published
files follow), the header is written from the plan, then the tensors are quantized and appended one at a
time (`gguf.GGUFWriter`'s streaming calls), so memory holds one tensor whatever the model's size. The file is
written under a `.partial` name and renamed once complete.

Quantizers: the `gguf` package's (Q8_0, Q5_0/1, Q4_0/1) and our own for the K-quants (`gguf_kquants`:
Q6_K ... Q2_K, with simpler scale choices than llama.cpp's). Other types (the I-quants) are refused, naming
llama.cpp's `llama-quantize`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flux_runtime.kernels.gguf_dequant import BY_NAME, PLAIN_DTYPES, PLAIN_TYPES
from flux_runtime.weights.convert_plan import ConversionPlan, plan_transformer
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.gguf_file import require_gguf
from flux_runtime.weights.gguf_kquants import K_TYPES, quantize_k

log = logging.getLogger(__name__)

# what `flux-convert gguf --type` writes, smallest error first
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K")
_PACKAGE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
# the type's values per block (a row must hold whole blocks), from the one table of GGML types
BLOCK = {name: BY_NAME[name].block for name in GGUF_TYPES}
# the embedders and the last layer stay in the source's float type, as in city96's files: they are small,
# and every image token passes through them. One tuple for every family, their names being disjoint: FLUX.1 /
# FLUX.2 (`img_in`, `vector_in`, `guidance_in`), FLUX.3 (`emb_in.image` / `.image_cond`, the flow map's
# `ref_time_in`); `txt_in`, `time_in` and `final_layer` are all three's
KEEP_PREFIXES = (
    "img_in.", "emb_in.", "txt_in.", "time_in.", "ref_time_in.", "vector_in.", "guidance_in.", "final_layer.",
)  # fmt: skip
# 1-D tensors and 2-D ones of at most this many values are written F32 (city96's threshold)
SMALL = 1024
# the `general.file_type` each --type writes (llama.cpp's numbering; an all-Q4_K file is its Q4_K_S)
_FILE_TYPES = {
    "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q6_K": "MOSTLY_Q6_K",
    "Q5_K": "MOSTLY_Q5_K_S", "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_K": "MOSTLY_Q4_K_S",
    "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0", "Q3_K": "MOSTLY_Q3_K_S", "Q2_K": "MOSTLY_Q2_K",
}  # fmt: skip
FP16_MAX = 65504.0
# a float tensor's GGML type name by its torch dtype (the plain types of the same table)
_FLOAT_NAMES = {dtype: PLAIN_TYPES[i].name for i, dtype in PLAIN_DTYPES.items()}


def check_type(qtype: str) -> str:
    """`qtype` in the GGML spelling (`q4_k` → `Q4_K`), or a one-line error listing the types written."""
    name = qtype.upper()
    if name in GGUF_TYPES:
        return name
    raise WeightsError(
        f"--type {qtype}: not a type flux-convert writes ({', '.join(GGUF_TYPES)}); for others (IQ4_XS, ...) "
        "write a Q8_0 or F16 file and quantize it with llama.cpp's llama-quantize, as city96's tools do"
    )


def tensor_type(name: str, shape: tuple[int, ...], source: torch.dtype, qtype: str) -> str:
    """The GGML type a BFL-named tensor is written in for `--type qtype`.

    - 1-D tensors (norm scales, biases) and tensors of at most `SMALL` values: F32 (exact from bf16/fp16);
    - the embedders and the final layer (`KEEP_PREFIXES`): the source's float type, unchanged;
    - 2-D weights whose rows are not whole blocks of `qtype`: the source's float type, unchanged;
    - every other weight: `qtype`.
    """
    if len(shape) != 2 or shape[0] * shape[1] <= SMALL:
        return "F32"
    kept = _FLOAT_NAMES[source]
    if name.startswith(KEEP_PREFIXES) or shape[-1] % BLOCK[qtype]:
        return kept
    return qtype


def _encode(name: str, values: Tensor, kind: str, gguf: Any) -> np.ndarray:
    """`values` in GGML type `kind`: typed values for F32/F16, uint8 bytes for BF16 and the block types.
    Values fp16 cannot hold (F16 and the block types' fp16 scales), NaN or infinite, are refused."""
    if kind not in ("F32", "BF16"):
        top = values.detach().abs().amax().item() if values.numel() else 0.0
        if not top <= FP16_MAX:
            raise WeightsError(f"{name}: largest |value| {top:g}, which {kind} (fp16 scales) cannot hold")
    if kind == "F32":
        return values.float().contiguous().numpy()
    if kind == "F16":
        return values.to(torch.float16).contiguous().numpy()
    if kind == "BF16":
        return values.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    if kind in K_TYPES:
        return quantize_k(values.float(), kind).numpy()
    return gguf.quants.quantize(values.float().contiguous().numpy(), gguf.GGMLQuantizationType[kind])


def _stored(shape: tuple[int, ...], kind: str, gguf: Any) -> tuple[tuple[int, ...], Any, int, Any]:
    """What `add_tensor_info` takes for a tensor of `shape` in `kind`: stored shape, numpy dtype, bytes,
    raw GGML type (None for F32/F16, which the writer names from the numpy dtype)."""
    n = int(np.prod(shape))
    if kind in ("F32", "F16"):
        dtype = np.float32 if kind == "F32" else np.float16
        return shape, np.dtype(dtype), n * np.dtype(dtype).itemsize, None
    qtype = gguf.GGMLQuantizationType[kind]
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype


@dataclass(frozen=True)
class GgufResult:
    """What `write_gguf` wrote: the file, the source's layout, tensors per GGML type, the file's size."""

    path: Path
    source_layout: str
    types: dict[str, int]
    num_tensors: int
    total_bytes: int


def _check_destination(dst: Path, sources: list[Path], overwrite: bool) -> None:
    if dst.suffix != ".gguf":
        raise WeightsError(f"{dst}: GGUF output is a single file; give a path ending in .gguf")
    if dst.is_dir():
        raise WeightsError(f"{dst} is a folder; GGUF output is a single .gguf file")
    if dst.resolve() in {p.resolve() for p in sources}:
        raise WeightsError(f"{dst}: the output would overwrite the input checkpoint; choose another path")
    if dst.exists() and not overwrite:
        raise WeightsError(f"{dst} already exists; pass overwrite (--overwrite) to replace it")


def plan_gguf(src: str | Path) -> ConversionPlan:
    """The BFL-named tensors of the FLUX.1, FLUX.2 or FLUX.3 transformer at `src` (every family the plan
    reads); FP8 checkpoints are refused."""
    plan = plan_transformer(src, to_bfl=True)
    for o in plan.outputs():
        if o.dtype not in _FLOAT_NAMES:  # FP8 weights: their error would add to the quantization's
            raise WeightsError(
                f"{plan.source[0]}: {o.key} is {str(o.dtype).removeprefix('torch.')}; flux-convert gguf quantizes "
                "bf16, fp16 or fp32 weights (convert from the bf16 checkpoint, not an FP8 one)"
            )
    return plan


def write_gguf(
    src: str | Path,
    dst: str | Path,
    qtype: str,
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> GgufResult:
    """Write the FLUX.1 / FLUX.2 / FLUX.3 transformer at `src` as the GGUF file `dst`, its weights in `qtype`.

    Tensor names are BFL's without a prefix, the metadata what city96's files carry (`general.architecture`
    "flux" — ComfyUI-GGUF's name for FLUX.1 and FLUX.2 alike, the model itself told apart by its keys, as
    diffusers and our loader tell FLUX.3's —,
    `general.quantization_version`, `general.file_type`); types per `tensor_type`. Raises `WeightsError`
    (bad source, destination or type); a VAE, an FP8 or a GGUF source is refused by the plan.
    """
    qtype = check_type(qtype)
    gguf = require_gguf()
    plan = plan_gguf(src)
    dst = Path(dst).expanduser()
    _check_destination(dst, plan.source, overwrite)
    kinds = {o.key: tensor_type(o.key, o.shape, o.dtype, qtype) for o in plan.outputs()}
    fallback = [k for k, o in ((o.key, o) for o in plan.outputs()) if _falls_back(k, o.shape, qtype)]
    if fallback:
        log.warning(
            "%d weights whose rows are not whole %s blocks of %d are kept in the source's type (%s, ...)",
            len(fallback), qtype, BLOCK[qtype], fallback[0],
        )  # fmt: skip

    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch="flux")
    try:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[qtype]]))
        for o in plan.outputs():
            shape, dtype, nbytes, raw = _stored(o.shape, kinds[o.key], gguf)
            writer.add_tensor_info(o.key, shape, dtype, nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for step in plan.steps:
            tensors = step.run()
            for o in step.outputs:
                data = _encode(o.key, tensors[o.key], kinds[o.key], gguf)
                writer.write_tensor_data(data)
                if progress is not None:
                    progress(o.nbytes)
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dst)
    return GgufResult(dst, plan.source_layout, dict(Counter(kinds.values())), len(kinds), dst.stat().st_size)


def _falls_back(name: str, shape: tuple[int, ...], qtype: str) -> bool:
    """A weight `qtype` would take but for its rows, which are not whole blocks."""
    big = len(shape) == 2 and shape[0] * shape[1] > SMALL and not name.startswith(KEEP_PREFIXES)
    return big and shape[-1] % BLOCK[qtype] != 0
