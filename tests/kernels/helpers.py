"""Shapes and inputs shared by the kernel tests: the FLUX sites, and the CPU/GPU run conditions.

GPU tests (`gpu` marker) run the compiled kernels at full FLUX sizes and demand `torch.equal`.
CPU tests run the same kernels under the Triton interpreter (`TRITON_INTERPRET=1` set before import,
as CI does) on a few rows with small blocks; they skip when the interpreter is off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import triton_utils
from flux_runtime.kernels.gelu import (
    all_half_values,
    gelu_amax_bound,
    gelu_tanh_triton,
)

HAS_CUDA = torch.cuda.is_available()
INTERPRET = triton_utils.INTERPRET and triton_utils.HAS_TRITON

# GPU runs need compiled kernels: the interpreter would copy CUDA tensors to the host.
gpu = pytest.mark.skipif(
    not (HAS_CUDA and triton_utils.HAS_TRITON) or triton_utils.INTERPRET,
    reason="needs a CUDA GPU, Triton, and TRITON_INTERPRET unset",
)
interpreter = pytest.mark.skipif(
    not INTERPRET, reason="set TRITON_INTERPRET=1 before import to run the Triton kernels on the CPU"
)

DTYPES = (torch.bfloat16, torch.float16)
WIDTHS = (3072, 6144)  # FLUX.1 / FLUX.2 hidden sizes
HEADS = {3072: 24, 6144: 48}  # heads of 128
TXT_TOKENS = 512
IMAGE_TOKENS = {"512x512": 1024, "1024x1024": 4096, "768x1344": 4032}
# txt stream, img stream and joint (single-block) lengths at the three image sizes
SEQ_LENS = tuple(
    sorted({TXT_TOKENS, *IMAGE_TOKENS.values(), *(TXT_TOKENS + n for n in IMAGE_TOKENS.values())})
)
BATCHES = (1, 2)
# rows not a multiple of any block, width not a multiple of 512 (aten threads with fewer elements)
ODD_ROWS = (2, 7, 1000)
ODD_HEADS = 3

# every (B, L, D) site of the row-wise ops, plus the odd size
FLUX_ROWS = [(b, n, d) for d in WIDTHS for n in SEQ_LENS for b in BATCHES] + [ODD_ROWS]
# (B, L_txt, L_img, H) for QK-norm + RoPE: double blocks (text + image) and single blocks (joint only)
FLUX_QK = [(b, TXT_TOKENS, n, HEADS[d]) for d in WIDTHS for n in IMAGE_TOKENS.values() for b in BATCHES]
FLUX_QK += [(b, 0, TXT_TOKENS + n, HEADS[d]) for d in WIDTHS for n in IMAGE_TOKENS.values() for b in BATCHES]
FLUX_QK += [(2, 3, 5, ODD_HEADS)]


def row_id(shape: tuple[int, ...]) -> str:
    """Readable pytest id for a shape tuple."""
    return "x".join(map(str, shape))


def modulation(
    b: int, d: int, dtype: torch.dtype, device: str | torch.device, chunks: int = 6
) -> list[Tensor]:
    """`chunks` (B, D) views of one (B, chunks * D) projection output, as the model's `chunk` gives.

    Row stride chunks * D, unit last stride: the layout the kernels see in FLUX.
    """
    out = (torch.randn(b, chunks * d, device=device) * 0.6).to(dtype)
    return list(out.chunk(chunks, dim=1))


def activations(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> Tensor:
    """Activations with a per-row offset and spread, so row means and variances are not trivial."""
    x = torch.randn(shape, device=device)
    offset = torch.randn(*shape[:-1], 1, device=device) * 2
    spread = torch.rand(*shape[:-1], 1, device=device) * 4 + 0.25
    return (x * spread + offset).to(dtype)


def modulated_rows(
    shape: tuple[int, int, int], dtype: torch.dtype, device: str | torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(x, shift, scale) at a (B, L, D) site: `activations`, then the (B, D) shift and scale of a `modulation`."""
    b, _, d = shape
    shift, scale = modulation(b, d, dtype, device)[:2]
    return activations(shape, dtype, device), shift, scale


def rope_tables(length: int, device: str | torch.device) -> tuple[Tensor, Tensor]:
    """(L, 128) fp32 cos/sin built as diffusers builds FLUX.1's (axes 16/56/56, theta 10000)."""
    pos = torch.stack(
        [torch.zeros(length), torch.randint(0, 64, (length,)), torch.randint(0, 84, (length,))], dim=1
    ).to(torch.float64)
    cos, sin = [], []
    for axis, d in enumerate((16, 56, 56)):
        omega = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(pos[:, axis], omega)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1).to(device), torch.cat(sin, dim=-1).to(device)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Distance in units in the last place between same-dtype 16-bit tensors (sign-magnitude aware)."""

    def ordered(t: Tensor) -> Tensor:
        i = t.view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


# FLUX.3 Klein: 24 heads of 128 (hidden 3072); image tokens at 512² and 1024², text padded to multiples of
# 80 (80 ... 480 typical, 512 as a longer prompt), references of the image's size (0 or 1 of them), and
# the joint [txt | image | image_cond] lengths of the single blocks
FLUX3_HEADS = 24
FLUX3_WIDTH = 3072
FLUX3_TXT_TOKENS = (80, 480)
FLUX3_IMAGE_TOKENS = (1024, 4096)
FLUX3_SEQ_LENS = tuple(
    sorted(
        {*FLUX3_TXT_TOKENS, *FLUX3_IMAGE_TOKENS}
        | {t + n * (1 + refs) for t in FLUX3_TXT_TOKENS for n in FLUX3_IMAGE_TOKENS for refs in (0, 1)}
    )
)


# (B, L_txt, L, D): FLUX.3's per-mode blocks (text, image or reference alone) and joint blocks
# ([txt | image (| ref)])
FLUX3_SITES = sorted(
    {(b, 0, n, FLUX3_WIDTH) for b in (1, 2) for n in (*FLUX3_TXT_TOKENS, *FLUX3_IMAGE_TOKENS)}
    | {
        (b, t, n * (1 + refs), FLUX3_WIDTH)
        for b in (1, 2)
        for t in FLUX3_TXT_TOKENS
        for n in FLUX3_IMAGE_TOKENS
        for refs in (0, 1)
    }
)
# (B, L): the rows of those sites' joint sequences
FLUX3_ROWS = sorted({(b, n_txt + n) for b, n_txt, n, _ in FLUX3_SITES})


def token_modulation(
    b: int, n: int, d: int, dtype: torch.dtype, device: str | torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(shift, scale, gate) (B, L, D) chunks of one per-token (B, L, 3D) projection, as FLUX.3's `chunk` gives."""
    mod = (torch.randn(b, n, 3 * d, device=device) * 0.6).to(dtype)
    shift, scale, gate = mod.chunk(3, dim=-1)
    return shift, scale, gate


def same(out: Tensor, ref: Tensor) -> Tensor:
    """Elementwise equality that counts NaN == NaN (the exhaustive inputs include NaNs)."""
    return (out == ref) | (out.isnan() & ref.isnan())


def assert_within_one_ulp(out: Tensor, ref: Tensor) -> None:
    """At most 1 ulp from aten's CPU kernel (which reduces in another order), and equal almost everywhere."""
    assert int(ulp_distance(out, ref).max()) <= 1
    assert (out == ref).float().mean() > 0.99


def bits(t: Tensor) -> Tensor:
    """e4m3 bit patterns, NaN's two (either sign) folded into one: torch's casts disagree on its sign."""
    b = t.view(torch.uint8)
    return torch.where((b & 0x7F) == 0x7F, 0x7F, b)


def assert_same(a: Any, r: Any) -> None:
    """Two `Fp8Act`s hold the same e4m3 codes (NaNs folded) and the same scales."""
    diff = int((bits(a.data) != bits(r.data)).sum())
    assert diff == 0, f"{diff} of {a.data.numel()} e4m3 codes differ"
    assert torch.equal(a.scale, r.scale)


def pre_activation(b: int, n: int, d: int, m: int, act: str, dtype: torch.dtype, device: str) -> Tensor:
    """The MLP part of a `linear1` output (B, L, 3D + K): a column slice with the whole row's stride."""
    k = 2 * m if act == "swiglu" else m
    full = (torch.randn(b, n, 3 * d + k, device=device) * 3).to(dtype)
    return full[..., 3 * d :]


def gelu_threshold(dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    """(x*, the largest input below x*, the negative input whose |GELU| is the bound) of the kernels' own
    GELU: x* is the smallest input whose GELU reaches `gelu_amax_bound`, where the shortcut starts."""
    values = all_half_values(dtype, device)
    x, g = values.float(), gelu_tanh_triton(values).float()
    bound = gelu_amax_bound(dtype, torch.device(device))
    assert bound is not None
    x_star = x[(x >= 0) & (g >= bound)].min()
    below = x[(x >= 0) & (x < x_star)].max()
    neg = (x < 0) & x.isfinite()
    return float(x_star), float(below), float(x[neg][g[neg].abs().argmax()])


def gelu_rows(b: int, n: int, d: int, m: int, dtype: torch.dtype, device: str) -> Tensor:
    """FLUX.1's MLP slice (B, L, M) whose rows cycle through what decides a row's GELU absmax: a large
    maximum (the shortcut), a small one or none above zero (the GELU sweep), the largest input at x* (the
    shortcut, GELU(x*) the absmax) or just below it (the sweep: a negative input's |GELU| is the absmax), and
    zeros. Each small-maximum row holds the negative input with the bound's |GELU|, so taking the shortcut
    there would give a smaller, wrong, scale."""
    x_star, below, x_neg = gelu_threshold(dtype, device)
    x = pre_activation(b, n, d, m, "gelu_tanh", dtype, device)
    kind = torch.arange(n, device=device) % 6
    top = torch.tensor([0.0, 0.1, -(2**-6), x_star, below, 0.0], device=device)[kind]  # kinds 1 to 4
    rows = -(torch.rand(b, n, m, device=device) * 3 + 2**-6)
    rows[..., 0] = x_neg
    rows[..., m // 2] = top
    rows = torch.where((kind == 0)[:, None], x.float(), rows)
    rows[:, kind == 5] = 0
    x.copy_(rows.to(dtype))
    return x
