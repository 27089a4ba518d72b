#!/usr/bin/env python
"""Bit-exactness and speed of the fused Triton kernels at the FLUX shapes, on one CUDA GPU.

For every op in `flux_runtime.kernels`, every FLUX site shape (hidden 3072 / 6144, 24 / 48 heads of
128; 512 text tokens and the 512², 1024², 768×1344 images as text, image and joint streams; batch 1
and 2; one odd size) and bf16 and fp16:

1. fresh random inputs; the memory the fused outputs will land in is filled with NaN first (freed
   NaN blocks of the output sizes, which the caching allocator hands back), so an element the kernel
   fails to write shows up; then `torch.equal(fused, reference)` and no NaN in the fused output;
2. the median time of the fused kernel and of the eager reference chain (`triton.testing.do_bench`),
   and the fused kernel's bandwidth against the 4.16 TB/s device-to-device copy ceiling measured on
   the H200 (shared/reference/h200_baseline.md).

GELU is also checked exhaustively over all 65,536 inputs of each dtype. Exits 1 on any mismatch or
any shape a kernel's guards reject. Usage: `python scripts/kernel_check.py [--no-bench] [--op NAME]`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.gated_residual import gated_residual_reference, gated_residual_triton
from flux_runtime.kernels.gelu import all_half_values, gelu_tanh_reference, gelu_tanh_triton
from flux_runtime.kernels.layer_norm_modulate import (
    layer_norm_modulate_reference,
    layer_norm_modulate_triton,
    residual_layer_norm_modulate_reference,
    residual_layer_norm_modulate_triton,
)
from flux_runtime.kernels.modulate import modulate_reference, modulate_triton
from flux_runtime.kernels.qk_norm_rope import qk_norm_rope_reference, qk_norm_rope_triton

COPY_CEILING_GBS = 4160.0  # device-to-device copy, bytes read + written, H200
EPS = 1e-6
WIDTHS = {3072: 24, 6144: 48}  # hidden size -> heads of 128
TXT = 512
IMAGES = {"512²": 1024, "1024²": 4096, "768×1344": 4032}
BATCHES = (1, 2)
DTYPES = (torch.bfloat16, torch.float16)
FF_INNER = 12288  # FLUX.1 MLP hidden


@dataclass
class Case:
    op: str
    label: str
    dtype: torch.dtype
    make: Callable[[], tuple[Any, ...]]  # fresh random inputs
    fused: Callable[..., Any]
    reference: Callable[..., Any]
    nbytes: int  # minimal HBM traffic of the fused kernel


def _act(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    x = torch.randn(shape, device="cuda")
    offset = torch.randn(*shape[:-1], 1, device="cuda") * 2
    spread = torch.rand(*shape[:-1], 1, device="cuda") * 4 + 0.25
    return (x * spread + offset).to(dtype)


def _mod(b: int, d: int, dtype: torch.dtype) -> list[Tensor]:
    """shift, scale, gate as (B, D) chunk views of one (B, 6D) modulation output, as in the model."""
    return list((torch.randn(b, 6 * d, device="cuda") * 0.6).to(dtype).chunk(6, dim=1))


def _rope(length: int) -> tuple[Tensor, Tensor]:
    pos = torch.stack(
        [torch.zeros(length), torch.randint(0, 64, (length,)), torch.randint(0, 84, (length,))], dim=1
    ).double()
    cos, sin = [], []
    for axis, d in enumerate((16, 56, 56)):
        angles = torch.outer(pos[:, axis], 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)))
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, -1).cuda(), torch.cat(sin, -1).cuda()


def _row_shapes() -> Iterator[tuple[str, int, int, int]]:
    lengths = {f"txt {TXT}": TXT}
    for name, n in IMAGES.items():
        lengths[f"img {name}"] = n
        lengths[f"joint {name}"] = TXT + n
    for d in WIDTHS:
        for name, n in lengths.items():
            for b in BATCHES:
                yield f"{name} B{b} D{d}", b, n, d
    yield "odd B2 L7 D1000", 2, 7, 1000


def cases(dtype: torch.dtype) -> Iterator[Case]:
    s = torch.empty((), dtype=dtype).element_size()
    for label, b, n, d in _row_shapes():
        bld, bd = b * n * d * s, b * d * s

        def mod_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale = _mod(b, d, dtype)[:2]
            return _act((b, n, d), dtype), shift, scale

        def res_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            gate = _mod(b, d, dtype)[2]
            return _act((b, n, d), dtype) * 4, gate, _act((b, n, d), dtype)

        def ln_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale = _mod(b, d, dtype)[:2]
            return _act((b, n, d), dtype), shift, scale, EPS

        def rln_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale, gate = _mod(b, d, dtype)[:3]
            return _act((b, n, d), dtype) * 4, gate, _act((b, n, d), dtype), shift, scale, EPS

        yield Case("modulate", label, dtype, mod_in, modulate_triton, modulate_reference, 2 * bld + 2 * bd)
        yield Case(
            "gated_residual",
            label,
            dtype,
            res_in,
            gated_residual_triton,
            gated_residual_reference,
            3 * bld + bd,
        )
        yield Case(
            "layer_norm_modulate", label, dtype, ln_in, layer_norm_modulate_triton,
            layer_norm_modulate_reference, 2 * bld + 2 * bd,
        )  # fmt: skip
        yield Case(
            "residual_layer_norm_modulate", label, dtype, rln_in, residual_layer_norm_modulate_triton,
            residual_layer_norm_modulate_reference, 4 * bld + 3 * bd,
        )  # fmt: skip

    qk_shapes = [
        (f"double {name} B{b} H{h}", b, TXT, n, h)
        for h in WIDTHS.values()
        for name, n in IMAGES.items()
        for b in BATCHES
    ]
    qk_shapes += [
        (f"single {name} B{b} H{h}", b, 0, TXT + n, h)
        for h in WIDTHS.values()
        for name, n in IMAGES.items()
        for b in BATCHES
    ]
    qk_shapes.append(("odd B2 L3+5 H3", 2, 3, 5, 3))
    for label, b, n_txt, n_img, h in qk_shapes:

        def qk_in(b: int = b, n_txt: int = n_txt, n_img: int = n_img, h: int = h) -> tuple[Any, ...]:
            x_img = _act((b, n_img, h, 128), dtype)
            w_img = (torch.rand(128, device="cuda") * 2).to(dtype)
            x_txt = _act((b, n_txt, h, 128), dtype) if n_txt else None
            w_txt = (torch.rand(128, device="cuda") * 2).to(dtype) if n_txt else None
            return (x_txt, x_img, w_txt, w_img, *_rope(n_txt + n_img), EPS)

        nbytes = 2 * b * (n_txt + n_img) * h * 128 * s + 2 * (n_txt + n_img) * 128 * 4
        yield Case("qk_norm_rope", label, dtype, qk_in, qk_norm_rope_triton, qk_norm_rope_reference, nbytes)

    gelu_rows = [(f"{name} B{b}", b * n) for name, n in [("txt", TXT), *IMAGES.items()] for b in BATCHES]
    gelu_rows += [(f"joint {name} B{b}", b * (TXT + n)) for name, n in IMAGES.items() for b in BATCHES]
    gelu_rows.append(("odd 3x1001", -1))
    for label, rows in gelu_rows:
        shape = (rows, FF_INNER) if rows > 0 else (3, 1001)

        def gelu_in(shape: tuple[int, int] = shape) -> tuple[Any, ...]:
            return ((torch.randn(shape, device="cuda") * 3).to(dtype),)

        numel = shape[0] * shape[1]
        yield Case("gelu_tanh", label, dtype, gelu_in, gelu_tanh_triton, gelu_tanh_reference, 2 * numel * s)


def _outputs(x: Any) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _poison_allocator(like: tuple[Tensor, ...]) -> None:
    """Leave NaN-filled free blocks of the output sizes in the caching allocator for the kernel's outputs."""
    blocks = [torch.full_like(t, float("nan")) for t in like]
    torch.cuda.synchronize()
    del blocks


def check(case: Case) -> str | None:
    """None if the fused op equals the reference on fresh inputs, else what went wrong."""
    args = case.make()
    ref = _outputs(case.reference(*args))
    _poison_allocator(ref)
    try:
        out = _outputs(case.fused(*args))
    except UnsupportedInput as e:
        return f"rejected by the kernel's guards: {e}"
    torch.cuda.synchronize()
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"output {i}: {tuple(o.shape)}/{o.dtype} vs reference {tuple(r.shape)}/{r.dtype}"
        if bool(o.isnan().any()):
            return f"output {i}: {int(o.isnan().sum())} elements never written (NaN poison left)"
        if not torch.equal(o, r):
            bad = int((o != r).sum())
            diff = (o.float() - r.float()).abs().max().item()
            return f"output {i}: {bad} of {o.numel()} elements differ, max |diff| {diff:.3g}"
    return None


def check_gelu_exhaustive(dtype: torch.dtype) -> str | None:
    x = all_half_values(dtype, "cuda")
    out, ref = gelu_tanh_triton(x), gelu_tanh_reference(x)
    same = (out == ref) | (out.isnan() & ref.isnan())
    if bool(same.all()):
        return None
    return f"{int((~same).sum())} of 65536 inputs differ, e.g. {x[~same][:6].float().tolist()}"


def bench_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 1), rep=rep_ms, return_mode="median"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="check bit-exactness only")
    parser.add_argument("--op", action="append", help="only these ops (repeatable)")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench time per measurement (ms)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    failures: list[str] = []

    for dtype in DTYPES:
        if not opts.op or "gelu_tanh" in opts.op:
            problem = check_gelu_exhaustive(dtype)
            print(
                f"gelu_tanh all 65536 {str(dtype)[6:]} inputs: {'bit-exact' if problem is None else problem}"
            )
            if problem is not None:
                failures.append(f"gelu_tanh exhaustive {dtype}: {problem}")

    header = f"{'op':<29} {'shape':<26} {'dtype':<8} {'exact':<5}"
    if not opts.no_bench:
        header += f" {'fused us':>9} {'eager us':>9} {'speedup':>7} {'GB/s':>7} {'% copy':>6}"
    print(header)
    for dtype in DTYPES:
        for case in cases(dtype):
            if opts.op and case.op not in opts.op:
                continue
            problem = check(case)
            line = (
                f"{case.op:<29} {case.label:<26} {str(dtype)[6:]:<8} {'yes' if problem is None else 'NO':<5}"
            )
            if problem is not None:
                failures.append(f"{case.op} {case.label} {dtype}: {problem}")
            elif not opts.no_bench:
                args = case.make()
                fused_ms = bench_ms(lambda: case.fused(*args), opts.rep_ms)  # noqa: B023
                ref_ms = bench_ms(lambda: case.reference(*args), opts.rep_ms)  # noqa: B023
                gbs = case.nbytes / fused_ms / 1e6
                line += (
                    f" {fused_ms * 1e3:9.1f} {ref_ms * 1e3:9.1f} {ref_ms / fused_ms:6.2f}x"
                    f" {gbs:7.0f} {100 * gbs / COPY_CEILING_GBS:5.0f}%"
                )
            print(line, flush=True)

    if failures:
        print(f"\n{len(failures)} FAILURES:")
        for f in failures:
            print(f"  {f}")
        return 1
    print("\nall fused kernels bit-exact against their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
