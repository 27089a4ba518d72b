#!/usr/bin/env python3
"""Compile the fused LayerNorm kernels (FLUX.3's per-token ones, FLUX.1/2's rows kernel), the single block's
`[attention | activation]` FP8 producer, the QK norm + RoPE kernels and FLUX.3's other fused Triton kernels for
sm_90 on a machine without a GPU, and print their resources.

Triton lowers each kernel (at its default tile, bf16 and fp16, the masked odd-width LayerNorm path too) to PTX
and runs its bundled ptxas, which catches lowering errors the interpreter never meets; `cuobjdump` then reads
registers and stack (spills) per thread from the cubin, and the PTX gives the count of fp32 FMAs (each must be
one aten has: Welford's and the sum of squares), of separately rounded fp32 products (`mul.rn.f32`) and of the
hardware e4m3 conversions (`cvt.rn.satfinite.e4m3x2.f32`, two codes each) of the FP8 producers. Nothing
runs; it says nothing about speed or bits.
`--ptx DIR` also writes each kernel's PTX there: two trees whose PTX files are identical run the same
instructions on the GPU, so a refactor of a kernel's source can be shown to move no bits without one.
Usage: `python3 scripts/compile_check.py [--ptx DIR]` (a minute or two on two CPU cores). Exit status 1 if any
kernel fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.kernels.attention_act_fp8 import _attention_act_quant_rows_kernel
from flux_runtime.kernels.fp8 import _act_quant_rows_kernel
from flux_runtime.kernels.gelu import K_BETA, K_KAPPA
from flux_runtime.kernels.layer_norm_modulate import _layer_norm_modulate_rows_kernel
from flux_runtime.kernels.qk_norm_rope import _qk_norm_rope_kernel, _qk_norm_rope_tiles_kernel
from flux_runtime.kernels.qk_norm_rope_fp32 import _qk_norm_rope_fp32_kernel
from flux_runtime.kernels.token_gated_residual import _token_gated_residual_kernel
from flux_runtime.kernels.token_layer_norm_modulate import ROWS_PER_PROGRAM, _token_layer_norm_modulate_kernel

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# `gelu_amax_bound` as the interpreter finds it: the launch passes the device's own, established at run time,
# which only changes this constant (the tanh-GELU producer's max shortcut; "two GELUs" is the path without it)
GELU_BOUND = {"bf16": 0.169921875, "fp16": 0.1700439453125}


def _ints(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


def kernels(dt: str, tdt: object) -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """(label, kernel, signature, constexprs) at the launchers' defaults for one activation dtype."""
    ln_sig = dict.fromkeys(
        ("xa_ptr", "sha_ptr", "sca_ptr", "xb_ptr", "shb_ptr", "scb_ptr", "out_ptr"), f"*{dt}"
    )
    ln_sig |= dict.fromkeys(("q_scale_ptr", "q_inv_ptr"), "*fp32")
    ln_sig |= _ints("La", "L", "D") | {"eps": "fp32"}
    ln_sig |= _ints(*(f"s_{t}_{d}" for t in ("xa", "sha", "sca", "xb", "shb", "scb") for d in ("b", "l")))
    ln8_sig = ln_sig | {"out_ptr": "*u8"}  # QUANT: e4m3 bits
    rows_sig = dict.fromkeys(
        ("x_ptr", "gate_ptr", "upd_ptr", "shift_ptr", "scale_ptr", "r_out_ptr", "y_out_ptr"), f"*{dt}"
    )
    rows_sig |= dict.fromkeys(("q_scale_ptr", "q_inv_ptr"), "*fp32") | _ints("L", "D") | {"eps": "fp32"}
    rows_sig |= _ints(*(f"stride_{n}" for n in ("xb", "xl", "gate", "ub", "ul", "shift", "scale")))
    rows8_sig = rows_sig | {"y_out_ptr": "*u8"}
    aa_sig = {"o_ptr": f"*{dt}", "x_ptr": f"*{dt}", "q_ptr": "*u8", "scale_ptr": "*fp32"}
    aa_sig |= _ints("L", "D", "N", "HD", "stride_ob", "stride_ol", "stride_oh", "stride_xb", "stride_xl")
    # HW_E4M3: e4m3 codes from the GPU's conversion instruction, as an sm_89+ launch takes them (e4m3_consts)
    aa = {"BLOCK": 2048, "GPU": True, "HW_E4M3": True, "BETA": K_BETA, "KAPPA": K_KAPPA}
    aa |= {"MAX_SHORTCUT": False, "GELU_BOUND": 0.0}
    aa_max = aa | {"MAX_SHORTCUT": True, "GELU_BOUND": GELU_BOUND[dt]}
    aq_sig = {"x_ptr": f"*{dt}", "q_ptr": "*u8", "scale_ptr": "*fp32", "inv_ptr": "*fp32"}
    aq_sig |= _ints("L", "N", "stride_xb", "stride_xl", "stride_qb", "stride_ql")
    aq = {
        "DYNAMIC": True,
        "GPU": True,
        "HW_E4M3": True,
        "BETA": K_BETA,
        "KAPPA": K_KAPPA,
        "MAX_SHORTCUT": False,
        "GELU_BOUND": 0.0,
    }
    aq_max = aq | {"MAX_SHORTCUT": True, "GELU_BOUND": GELU_BOUND[dt]}
    qk_sig = dict.fromkeys(("q_ptr", "k_ptr"), f"*{dt}") | dict.fromkeys(
        ("wq_ptr", "wk_ptr", "cos_ptr", "sin_ptr"), "*fp32"
    )
    qk_sig |= dict.fromkeys(("qo_ptr", "ko_ptr"), f"*{dt}") | _ints("B", "L", "H") | {"eps": "fp32"}
    qk_sig |= _ints(*(f"stride_{t}{d}" for t in ("q", "k", "qo", "ko") for d in ("b", "l", "h")))
    # the joint QK norm + RoPE (FLUX.1/2): text and image streams in, the joint q or k out through its strides
    jqk_sig = dict.fromkeys(("txt_ptr", "img_ptr", "w_txt_ptr", "w_img_ptr"), f"*{dt}")
    jqk_sig |= dict.fromkeys(("cos_ptr", "sin_ptr"), "*fp32") | {"out_ptr": f"*{dt}"}
    jqk_sig |= _ints("L_txt", "L_joint", "H") | {"eps": "fp32"}
    jqk_sig |= _ints(*(f"stride_{t}{d}" for t in ("t", "i", "o") for d in ("b", "l", "h")))
    gr_sig = dict.fromkeys(
        ("xa_ptr", "ga_ptr", "xb_ptr", "gb_ptr", "a_ptr", "b_ptr", "outa_ptr", "outb_ptr"), f"*{dt}"
    )
    gr_sig |= _ints("La", "L", "D") | _ints(
        *(f"s_{t}_{d}" for t in ("xa", "ga", "xb", "gb", "a", "b") for d in ("b", "l"))
    )
    ln = {"ROWS": ROWS_PER_PROGRAM, "GPU": True, "HW_E4M3": True, "DTYPE": tdt}
    rows = {"ROWS": 2, "GPU": True, "HW_E4M3": True, "DTYPE": tdt}
    tok = _token_layer_norm_modulate_kernel
    return [
        (f"token_layer_norm_modulate D3072 {dt}", tok, ln_sig, {"ITERS": 6, "EVEN": True, "QUANT": 0, **ln}),
        (f"token_layer_norm_modulate D1000 {dt}", tok, ln_sig, {"ITERS": 2, "EVEN": False, "QUANT": 0, **ln}),
        (f"token_layer_norm_modulate_fp8 D3072 static {dt}", tok, ln8_sig, {"ITERS": 6, "EVEN": True, "QUANT": 1, **ln}),
        (f"token_layer_norm_modulate_fp8 D3072 per-row {dt}", tok, ln8_sig, {"ITERS": 6, "EVEN": True, "QUANT": 2, **ln}),
        (f"layer_norm_modulate D3072 {dt}", _layer_norm_modulate_rows_kernel, rows_sig, {"ITERS": 6, "EVEN": True, "HAS_RESIDUAL": False, "QUANT": 0, **rows}),
        (f"residual_layer_norm_modulate D6144 {dt}", _layer_norm_modulate_rows_kernel, rows_sig, {"ITERS": 12, "EVEN": True, "HAS_RESIDUAL": True, "QUANT": 0, **rows}),
        (f"residual_layer_norm_modulate D6144 1 row {dt}", _layer_norm_modulate_rows_kernel, rows_sig, {"ITERS": 12, "EVEN": True, "HAS_RESIDUAL": True, "QUANT": 0, **rows, "ROWS": 1}),
        (f"residual_layer_norm_modulate D1000 fp8 per-row {dt}", _layer_norm_modulate_rows_kernel, rows8_sig, {"ITERS": 2, "EVEN": False, "HAS_RESIDUAL": True, "QUANT": 2, **rows}),
        (f"attention_act_fp8 gelu_tanh {dt}", _attention_act_quant_rows_kernel, aa_sig, {"ACT": 1, **aa_max}),
        (f"attention_act_fp8 gelu_tanh two GELUs {dt}", _attention_act_quant_rows_kernel, aa_sig, {"ACT": 1, **aa}),
        (f"attention_act_fp8 gelu_tanh integer e4m3 {dt}", _attention_act_quant_rows_kernel, aa_sig, {"ACT": 1, **aa_max, "HW_E4M3": False}),
        (f"attention_act_fp8 swiglu {dt}", _attention_act_quant_rows_kernel, aa_sig, {"ACT": 2, **aa}),
        (f"fp8_quantize per-row one block {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 0, "BLOCK_N": 16384, "ONE_BLOCK": True, **aq}),
        (f"swiglu_fp8 per-row blocks {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 2, "BLOCK_N": 2048, "ONE_BLOCK": False, **aq}),
        (f"gelu_tanh_fp8 per-row one block 16 warps {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 1, "BLOCK_N": 16384, "ONE_BLOCK": True, **aq, "_warps": 16}),
        (f"swiglu_fp8 per-row one block 16 warps {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 2, "BLOCK_N": 16384, "ONE_BLOCK": True, **aq, "_warps": 16}),
        (f"fp8_quantize per-row one block 4096 8 warps {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 0, "BLOCK_N": 4096, "ONE_BLOCK": True, **aq, "_warps": 8}),
        (f"gelu_tanh_fp8 per-row 1024 blocks {dt}", _act_quant_rows_kernel, aq_sig, {"ACT": 1, "BLOCK_N": 1024, "ONE_BLOCK": False, **aq_max}),
        (f"qk_norm_rope_fp32 8x8 {dt}", _qk_norm_rope_fp32_kernel, qk_sig, {"TOKS": 8, "HB": 8, "GPU": True}),
        (f"qk_norm_rope v1 8 heads {dt}", _qk_norm_rope_kernel, jqk_sig, {"HEADS": 8, "GPU": True}),
        (f"qk_norm_rope v2 8x8 {dt}", _qk_norm_rope_tiles_kernel, jqk_sig, {"TOKS": 8, "HB": 8, "GPU": True}),
        (f"token_gated_residual 2x1024 {dt}", _token_gated_residual_kernel, gr_sig, {"BLOCK_L": 2, "BLOCK_D": 1024, "GPU": True}),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", type=Path, default=None, help="write each kernel's PTX into this folder")
    args = ap.parse_args()
    if args.ptx is not None:
        args.ptx.mkdir(parents=True, exist_ok=True)
    failures = 0
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    print(f"{'kernel':<56} {'regs':>5} {'stack':>6} {'fma.f32':>8} {'mul.rn':>7} {'cvt.e4m3':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for dt, tdt in (("bf16", tl.bfloat16), ("fp16", tl.float16)):
            for label, fn, sig, consts in kernels(dt, tdt):
                consts = dict(consts)
                warps = consts.pop("_warps", 4)  # the launch's num_warps where it is not 4
                try:
                    src = ASTSource(fn, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
                    k = triton.compile(
                        src, target=TARGET, options={"num_warps": warps, "enable_fp_fusion": False}
                    )
                except Exception as e:  # report every kernel, then set the exit status
                    failures += 1
                    print(f"{label:<56} FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
                    continue
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(k.asm["cubin"])
                usage = subprocess.run(
                    [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
                ).stdout
                regs = re.search(r"REG:(\d+)", usage)
                stack = re.search(r"STACK:(\d+)", usage)
                ptx = k.asm["ptx"]
                if args.ptx is not None:
                    (args.ptx / (re.sub(r"[^A-Za-z0-9]+", "_", label) + ".ptx")).write_text(ptx)
                print(
                    f"{label:<56} {regs.group(1) if regs else '?':>5} {stack.group(1) if stack else '?':>6} "
                    f"{ptx.count('fma.rn.f32'):>8} {ptx.count('mul.rn.f32'):>7} {ptx.count('cvt.rn.satfinite.e4m3x2'):>8}"
                )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
