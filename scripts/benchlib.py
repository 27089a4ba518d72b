"""What the GPU benches share: CUDA timing, the library floor, the full-size diffusers/ours model pairs of each
family with one step's inputs, the parity-then-time loop and the per-step table.

Imported by bench.py and the bench_*.py scripts beside it; it imports none of them, so imports run one way
(bench.py, the entry that dispatches sections, may import the bench_* modules; they import only this).
diffusers and the FLUX.3 text ids are imported where they are used: importing this needs neither a GPU nor
diffusers.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flux_runtime.models.dit import (
    FLUX1_DEV,
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    FLUX3_KLEIN,
    FLUX3_KLEIN_BASE,
    DiTConfig,
    Flux1Transformer,
    Flux2Transformer,
    Flux3Transformer,
)
from flux_runtime.sampling.flux3 import flux3_image_ids
from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout
from flux_runtime.weights.diffusers_config import vae_diffusers_config

DEV = torch.device("cuda")


def require_cuda(script: str) -> bool:
    """False (and a line on stderr) without a CUDA GPU; else print the GPU and torch version, True."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    return True


def free_cuda() -> None:
    """Collect garbage, then hand the CUDA caching allocator's free blocks back (before the next model)."""
    gc.collect()
    torch.cuda.empty_cache()


def finish_run(results: dict[str, object], t0: float, json_path: Path | None) -> None:
    """Note the run's wall time since `t0` in `results` ("wall_s"), print it, and write `results` as JSON to
    `json_path` if given."""
    results["wall_s"] = time.perf_counter() - t0
    print(f"total {results['wall_s']:.0f} s")
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))


# ---- timing ---------------------------------------------------------------------------------------------


def cuda_event_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()`'s result and the ms between CUDA events recorded around it (synchronizes after)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end)


def cuda_time(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median ms of `fn()` over `iters` runs after `warmup`, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    return statistics.median([cuda_event_ms(fn)[1] for _ in range(iters)])


def profile_step(
    fn: Callable[[], Any], rows: int = 18, warmup: bool = True, title: str | None = None
) -> None:
    """Print the kernel table (the `rows` kernels of most CUDA time, under `title` if given) of one call of
    `fn`, after a warm-up call unless `warmup` is False."""
    from torch.profiler import ProfilerActivity, profile

    if warmup:
        fn()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if title is not None:
        print(title)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def max_abs_diff(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.float() - expected.float()).abs().max().item()


# ---- the library floor ----------------------------------------------------------------------------------


def gemm_floor_ms(gemms: Counter[tuple[int, int, int]], bias: bool = False) -> float:
    """Summed ms of a step's GEMMs, `(M, K, N) -> calls`, each shape timed alone as a bf16 `F.linear`
    (with a bias when `bias`) on random operands, 20 timed runs."""
    total = 0.0
    for (m, k, n), count in gemms.items():
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        if bias:
            b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
            total += count * cuda_time(lambda x=x, w=w, b=b: F.linear(x, w, b), iters=20)
        else:
            total += count * cuda_time(lambda x=x, w=w: F.linear(x, w), iters=20)
        del x, w
    return total


def sdpa_floor_ms(cfg: DiTConfig, calls: list[tuple[int, int]]) -> float:
    """Summed ms of a step's SDPA calls, `(sequence length, calls)`, each length timed alone at `cfg`'s heads."""
    total = 0.0
    for length, count in calls:
        q, k, v = (
            torch.randn(1, cfg.num_heads, length, cfg.head_dim, device=DEV, dtype=torch.bfloat16)
            for _ in range(3)
        )
        total += count * cuda_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), iters=20)
    return total


def fa3_floor_ms(cfg: DiTConfig, calls: list[tuple[int, int]]) -> float | None:
    """Summed ms of a step's attention calls as FA3's e4m3 forward (`fa3-fp8`, per-head descales, k and v
    head-major as the producers write them), each length timed alone; None where it cannot run here."""
    from flux_runtime.kernels import attention_backends as backends
    from flux_runtime.kernels.attention_quant import quantize_heads_reference

    if backends.fp8_obstacle(torch.device(DEV), torch.bfloat16, cfg.head_dim) is not None:
        return None
    total = 0.0
    for length, count in calls:
        q, k, v = (
            torch.randn(1, length, cfg.num_heads, cfg.head_dim, device=DEV, dtype=torch.bfloat16)
            for _ in range(3)
        )
        q8 = quantize_heads_reference(q)
        k8, v8 = (quantize_heads_reference(t, head_major=True) for t in (k, v))
        total += count * cuda_time(partial(backends.fa3_fp8_attention, q8, k8, v8), iters=20)
    return total


# ---- models: diffusers' on the GPU, ours on its tensors -------------------------------------------------


def share_weights(ref, cfg: DiTConfig, layout, model_cls, flag: bool):
    """Our `model_cls(cfg)` on the very tensors of the diffusers model `ref`, renamed by `layout`'s rule table
    (`flag`: the table's third argument, guidance embedder or flow map); fused rules make new tensors."""
    sd = ref.state_dict()
    table = layout.rules(cfg.depth, cfg.depth_single_blocks, flag)
    ours_sd = {r.bfl: layout.diffusers_to_bfl(r, sd.__getitem__) for r in table}
    with torch.device("meta"):
        ours = model_cls(cfg)
    ours.load_state_dict(ours_sd, strict=True, assign=True)  # assign: share, do not copy
    return ours.eval()


def born_bf16(cls, **kw):
    """`cls(**kw)` in eval mode, drawn under `torch.manual_seed(0)` directly on the GPU in bf16 (a full-size
    model in fp32 would not fit beside anything)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            return cls(**kw).eval()
    finally:
        torch.set_default_dtype(default)


def perturb_norms(ref, fp32_qk_norms: bool = False) -> None:
    """Add 0.1 N(0, 1) to every 1-d parameter of `ref` (the QK-norm weights start at 1; make them matter); with
    `fp32_qk_norms`, then hold the QK-norm weights in fp32, as `from_pretrained` keeps FLUX.3's."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
                if fp32_qk_norms and (".norm_q." in name or ".norm_k." in name):
                    p.data = p.data.float()


def diffusers_fn(ref, txt: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor, **fixed: Any):
    """The diffusers transformer `ref` as `fn(x, t, **step) -> velocity`: latents `x` at `t` (= timestep / 1000)
    against the text states `txt`, with the keyword arguments `fixed` (FLUX.1's `pooled_projections`, the
    guidance, FLUX.3's reference stream) and `step` (FLUX.3's `target_timestep`), as the pipelines call it."""

    def fn(x: torch.Tensor, t: torch.Tensor, **step: Any) -> torch.Tensor:
        return ref(
            hidden_states=x, encoder_hidden_states=txt, timestep=t, img_ids=img_ids, txt_ids=txt_ids, **fixed,
            **step, return_dict=False,
        )[0]  # fmt: skip

    return fn


def diffusers_vae_kwargs(cfg) -> dict[str, Any]:
    """The arguments of diffusers' autoencoder class for our VAE config `cfg` (its config.json less `_` keys)."""
    return {k: v for k, v in vae_diffusers_config(cfg).items() if not k.startswith("_")}


# ---- parity, then time ----------------------------------------------------------------------------------


def parity_then_time(
    variants: dict, expected: torch.Tensor, iters: int, report, peaks: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, bool]]:
    """For each `label -> fn`: run it twice (a CUDA graph captures on the second call), compare with
    `expected` (`torch.equal`), `report(label, equal, diff)` (`diff`: "" or " (max abs diff ...)"), then time
    it with `cuda_time`; with `peaks`, also the peak allocated GiB while timing. Returns (ms, equal)."""
    times: dict[str, float] = {}
    equal: dict[str, bool] = {}
    for label, fn in variants.items():
        out = fn()
        out = fn()  # graphs: the first call runs eagerly, the second captures and replays
        equal[label] = torch.equal(out, expected)
        diff = "" if equal[label] else f" (max abs diff {max_abs_diff(out, expected):.3g})"
        report(label, equal[label], diff)
        del out
        if peaks is not None:
            torch.cuda.reset_peak_memory_stats()
        times[label] = cuda_time(fn, iters=iters)
        if peaks is not None:
            peaks[label] = torch.cuda.max_memory_allocated() / 2**30
    return times, equal


def print_step_table(
    title: str,
    floor: float,
    times: dict[str, float],
    equal: dict,
    equal_header: str = "torch.equal diffusers",
) -> None:
    """The per-step markdown table: the library floor, then each timed row (`times`, "diffusers eager" among
    them) in ms, / floor, / diffusers and its `equal` entry (blank where it has none)."""
    ref_ms = times["diffusers eager"]
    print()
    print(f"| {title} | ms | / floor | / diffusers | {equal_header} |")
    print("|---|---|---|---|---|")
    print(f"| library floor (GEMMs + SDPA) | {floor:.1f} | 1.00 | {floor / ref_ms:.2f} | |")
    for label, ms in times.items():
        cell = f" {equal[label]} " if label in equal else " "
        print(f"| {label} | {ms:.1f} | {ms / floor:.2f} | {ms / ref_ms:.2f} |{cell}|")


# ---- FLUX.1 ---------------------------------------------------------------------------------------------


def flux1_library_floor(
    cfg: DiTConfig = FLUX1_DEV, n_img: int = 4096, n_txt: int = 512
) -> tuple[float, float]:
    """Sum of the step's cuBLAS GEMMs (F.linear with bias, real shapes) and SDPA calls, each timed alone."""
    d, mlp, L = cfg.hidden_size, cfg.mlp_hidden_dim, n_img + n_txt
    gemms: Counter[tuple[int, int, int]] = Counter()
    for m in (n_img, n_txt):  # double blocks, per stream: q, k, v, out, mlp up, mlp down
        gemms[(m, d, d)] += 4 * cfg.depth
        gemms[(m, d, mlp)] += cfg.depth
        gemms[(m, mlp, d)] += cfg.depth
    gemms[(1, d, 6 * d)] += 2 * cfg.depth
    gemms[(L, d, d)] += 3 * cfg.depth_single_blocks
    gemms[(L, d, mlp)] += cfg.depth_single_blocks
    gemms[(L, d + mlp, d)] += cfg.depth_single_blocks
    gemms[(1, d, 3 * d)] += cfg.depth_single_blocks
    gemms[(n_img, cfg.in_channels, d)] += 1
    gemms[(n_txt, cfg.context_in_dim, d)] += 1
    gemms[(n_img, d, cfg.out_channels)] += 1
    gemms[(1, d, 2 * d)] += 1
    return gemm_floor_ms(gemms, bias=True), sdpa_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])


def flux1_pair(in_channels: int = 64):
    """Full-size FLUX.1-dev in diffusers (random init on the GPU) and ours with the same weights.

    `in_channels` 384 is FLUX.1 Fill's transformer (latents + masked-image latents + mask), 128 Depth/Canny's.
    """
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(DEV):
        ref = FluxTransformer2DModel(guidance_embeds=True, in_channels=in_channels, out_channels=64)
        ref = ref.to(torch.bfloat16).eval()
    cfg = replace(FLUX1_DEV, in_channels=in_channels, out_channels=64)
    return ref, share_weights(ref, cfg, flux1_layout, Flux1Transformer, cfg.guidance_embed)


def flux1_step_inputs(
    n_img: int = 4096,
    n_txt: int = 512,
    batch: int = 1,
    channels: int = 64,
    *,
    txt_dim: int = 4096,
    vec_dim: int = 768,
    device: torch.device = DEV,
):
    """One FLUX.1 step's inputs: packed latents, text states, pooled vector, bf16 ids, t/1000, guidance.

    `txt_dim` and `vec_dim` are the text states' and pooled vector's widths (T5-XXL's and CLIP-L's; a shrunk
    model's for a CPU smoke run, on `device`)."""
    g = torch.Generator(device=device).manual_seed(1)
    bf = torch.bfloat16
    img = torch.randn(batch, n_img, channels, device=device, generator=g).to(bf)
    txt = torch.randn(batch, n_txt, txt_dim, device=device, generator=g).to(bf)
    y = torch.randn(batch, vec_dim, device=device, generator=g).to(bf)
    side = int(n_img**0.5)
    ids = torch.zeros(side, side, 3, device=device)
    ids[..., 1] = torch.arange(side, device=device)[:, None]
    ids[..., 2] = torch.arange(side, device=device)[None, :]
    img_ids = ids.reshape(-1, 3).to(bf)
    txt_ids = torch.zeros(n_txt, 3, device=device, dtype=bf)
    t = torch.full((batch,), 988.0, device=device, dtype=bf) / 1000
    guidance = torch.full((batch,), 3.5, device=device)
    return img, img_ids, txt, txt_ids, t, y, guidance


# ---- FLUX.2 ---------------------------------------------------------------------------------------------

# name -> (our preset, diffusers Flux2Transformer2DModel kwargs); diffusers' defaults are FLUX.2 [dev]
FLUX2_MODELS: dict[str, tuple[DiTConfig, dict]] = {
    "dev": (FLUX2_DEV, {}),
    "klein-4b": (
        FLUX2_KLEIN_4B,
        dict(
            num_layers=5,
            num_single_layers=20,
            num_attention_heads=24,
            joint_attention_dim=7680,
            guidance_embeds=False,
        ),
    ),
    "klein-9b": (
        FLUX2_KLEIN_9B,
        dict(
            num_layers=8,
            num_single_layers=24,
            num_attention_heads=32,
            joint_attention_dim=12288,
            guidance_embeds=False,
        ),
    ),
}


def flux2_library_floor(cfg: DiTConfig, n_img: int = 4096, n_txt: int = 512) -> tuple[float, float]:
    """Sum of the step's cuBLAS GEMMs (F.linear, no bias, real shapes) and SDPA calls, each timed alone."""
    d, mlp, L = cfg.hidden_size, cfg.mlp_hidden_dim, n_img + n_txt
    gemms: Counter[tuple[int, int, int]] = Counter()  # (M, K, N) -> calls per step
    for m in (n_img, n_txt):  # double blocks, per stream: q, k, v, out, SwiGLU in (2 * mlp), out
        gemms[(m, d, d)] += 4 * cfg.depth
        gemms[(m, d, 2 * mlp)] += cfg.depth
        gemms[(m, mlp, d)] += cfg.depth
    gemms[(L, d, 3 * d + 2 * mlp)] += cfg.depth_single_blocks  # linear1
    gemms[(L, d + mlp, d)] += cfg.depth_single_blocks  # linear2
    # shared modulation (once per step), time (+ guidance) embedders, input/output projections, final adaLN
    gemms[(1, d, 6 * d)] += 2
    gemms[(1, d, 3 * d)] += 1
    gemms[(1, 256, d)] += 1 + cfg.guidance_embed
    gemms[(1, d, d)] += 1 + cfg.guidance_embed
    gemms[(n_img, cfg.in_channels, d)] += 1
    gemms[(n_txt, cfg.context_in_dim, d)] += 1
    gemms[(n_img, d, cfg.out_channels)] += 1
    gemms[(1, d, 2 * d)] += 1
    return gemm_floor_ms(gemms), sdpa_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])


def flux2_pair(cfg: DiTConfig, diffusers_kw: dict):
    """Full-size FLUX.2 in diffusers (random bf16 init on the GPU) and ours on the same weights."""
    from diffusers import Flux2Transformer2DModel

    ref = born_bf16(Flux2Transformer2DModel, **diffusers_kw)  # [dev] in fp32 would not fit beside anything
    perturb_norms(ref)
    return ref, share_weights(ref, cfg, flux2_layout, Flux2Transformer, cfg.guidance_embed)


def flux2_step_inputs(cfg: DiTConfig, n_img: int = 4096, n_txt: int = 512, batch: int = 1):
    """What the pipelines feed one step at 1024²: packed latents, text states, int64 ids, t/1000, guidance."""
    g = torch.Generator(device=DEV).manual_seed(1)
    bf = torch.bfloat16
    img = torch.randn(batch, n_img, cfg.in_channels, device=DEV, generator=g).to(bf)
    txt = torch.randn(batch, n_txt, cfg.context_in_dim, device=DEV, generator=g).to(bf)
    side = int(n_img**0.5)
    zero = torch.zeros(1, dtype=torch.long, device=DEV)
    img_ids = torch.cartesian_prod(zero, torch.arange(side, device=DEV), torch.arange(side, device=DEV), zero)
    txt_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(n_txt, device=DEV))
    t = torch.full((batch,), 988.0, device=DEV, dtype=bf) / 1000
    guidance = torch.full((batch,), 4.0, device=DEV) if cfg.guidance_embed else None
    return img, img_ids, txt, txt_ids, t, guidance


# ---- FLUX.3 ---------------------------------------------------------------------------------------------

FLUX3_MODELS: dict[str, DiTConfig] = {"base": FLUX3_KLEIN_BASE, "flow-map": FLUX3_KLEIN}
# 1024² (64 x 64 tokens); a prompt of up to 480 Qwen3-VL tokens (6 windows of 80)
FLUX3_N_IMG, FLUX3_N_TXT = 4096, 480


def flux3_step_shapes(
    cfg: DiTConfig, n_ref: int
) -> tuple[list[tuple[bool, tuple[int, int, int], int]], list[tuple[int, int]]]:
    """One FLUX.3 step's GEMMs `(block, (M, K, N), calls)` in the order the library floor counts them
    (`block`: a block projection, q, k, v, out or SwiGLU in/out, which FP8 quantizes; else an embedder, the
    per-token modulation, an input projection or the final layer), and its SDPA calls `(length, calls)`."""
    d, mlp = cfg.hidden_size, cfg.mlp_hidden_dim
    streams = [n for n in (FLUX3_N_TXT, FLUX3_N_IMG, n_ref) if n]
    joint = sum(streams)
    gemms: list[tuple[bool, tuple[int, int, int], int]] = []

    def block(m: int, count: int) -> None:  # q, k, v, out, SwiGLU in (2 * mlp), out
        gemms.extend(
            [(True, (m, d, d), 4 * count), (True, (m, d, 2 * mlp), count), (True, (m, mlp, d), count)]
        )

    for m in streams:
        block(m, cfg.depth)
        gemms.append((False, (m, d, 3 * d), 2))  # per-token modulation: early and single
    block(joint, cfg.depth_single_blocks)
    embedders = 2 + cfg.flow_map  # t, t = 0 (+ target)
    gemms += [(False, (1, 256, d), embedders), (False, (1, d, d), embedders)]
    gemms.append((False, (FLUX3_N_IMG, cfg.in_channels, d), 1))
    if n_ref:
        gemms.append((False, (n_ref, cfg.cond_in_channels, d), 1))
    gemms.append((False, (FLUX3_N_TXT, cfg.context_in_dim, d), 1))
    gemms.append((False, (FLUX3_N_IMG, d, 2 * d), 1))  # final adaLN, per token
    gemms.append((False, (FLUX3_N_IMG, d, cfg.out_channels), 1))
    attention = [*((m, cfg.depth) for m in streams), (joint, cfg.depth_single_blocks)]
    return gemms, attention


def flux3_library_floor(cfg: DiTConfig, n_ref: int) -> tuple[float, float]:
    """Sum of the step's cuBLAS GEMMs (F.linear, no bias, real shapes) and SDPA calls, each timed alone."""
    shapes, attention = flux3_step_shapes(cfg, n_ref)
    gemms: Counter[tuple[int, int, int]] = Counter()  # (M, K, N) -> calls per step
    for _, shape, count in shapes:
        gemms[shape] += count
    return gemm_floor_ms(gemms), sdpa_floor_ms(cfg, attention)


def flux3_pair(cfg: DiTConfig, **diffusers_kw: object):
    """Full-size FLUX.3 in diffusers (random bf16 init on the GPU, fp32 QK norms) and ours on the same tensors
    (`diffusers_kw` shrinks the diffusers model to match a smaller `cfg`)."""
    from diffusers import Flux3Transformer2DModel

    ref = born_bf16(Flux3Transformer2DModel, flow_map=cfg.flow_map, **diffusers_kw)
    perturb_norms(ref, fp32_qk_norms=True)
    return ref, share_weights(ref, cfg, flux3_layout, Flux3Transformer, cfg.flow_map)


def flux3_step_inputs(cfg: DiTConfig, n_ref: int):
    """What the pipeline feeds one step: packed latents, text states, float ids, t/1000 (and target) in bf16."""
    from flux_runtime.text.flux3 import text_ids

    g = torch.Generator(device=DEV).manual_seed(1)
    bf = torch.bfloat16
    img = torch.randn(1, FLUX3_N_IMG, cfg.in_channels, device=DEV, generator=g).to(bf)
    txt = torch.randn(1, FLUX3_N_TXT, cfg.context_in_dim, device=DEV, generator=g).to(bf)
    side = int(FLUX3_N_IMG**0.5)
    img_ids, txt_ids = flux3_image_ids(side, side, device=DEV), text_ids(FLUX3_N_TXT, DEV)
    ref = ref_ids = None
    if n_ref:
        ref = torch.randn(1, n_ref, cfg.cond_in_channels, device=DEV, generator=g).to(bf)
        rside = int(n_ref**0.5)
        ref_ids = flux3_image_ids(rside, rside, -1, device=DEV)
    t = (torch.tensor(988.0, device=DEV) / 1000).expand(1).to(bf)
    target = (torch.tensor(953.0, device=DEV) / 1000).expand(1).to(bf) if cfg.flow_map else None
    return img, img_ids, txt, txt_ids, t, ref, ref_ids, target
