"""What each rank runs in the parallel tests (importable by the spawned processes)."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from typing import Any

import torch

from flux_runtime.models.dit import TINY, TINY_FLUX2, Flux1Transformer, Flux2Transformer
from flux_runtime.parallel.group import ParallelConfig, join
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.sampling import flux2_image_ids, flux2_text_ids, image_ids

CPU = torch.device("cpu")


def random_model(family: str, heads: int, dtype: torch.dtype, seed: int = 0) -> Any:
    """A tiny transformer (2 double, 2 single blocks) with random weights, the same on every rank."""
    axes = (4, 6, 6) if family == "flux1" else (4, 4, 4, 4)
    base = TINY if family == "flux1" else TINY_FLUX2
    cfg = replace(base, num_heads=heads, hidden_size=16 * heads, axes_dim=axes)
    model = (Flux1Transformer if family == "flux1" else Flux2Transformer)(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()


def inputs(model: Any, batch: int, h: int, w: int, txt_len: int, seed: int = 1) -> tuple[tuple, dict]:
    """Full model inputs (args, kwargs with pe) of one step, the same on every rank."""
    cfg = model.config
    dtype = model.img_in.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(batch, h * w, cfg.in_channels, generator=gen).to(dtype)
    txt = torch.randn(batch, txt_len, cfg.context_in_dim, generator=gen).to(dtype)
    t = torch.full((batch,), 0.75, dtype=dtype)
    if cfg.family == "flux1":
        img_ids = image_ids(2 * h, 2 * w, dtype=dtype)  # the token grid h x w of a 2h x 2w latent
        txt_ids = torch.zeros(txt_len, 3, dtype=dtype)
        y = torch.randn(batch, cfg.vec_in_dim, generator=gen).to(dtype)
        args: tuple = (img, img_ids, txt, txt_ids, t, y, torch.full((batch,), 3.5))
    else:
        img_ids, txt_ids = flux2_image_ids(2 * h, 2 * w), flux2_text_ids(txt_len)
        args = (img, img_ids, txt, txt_ids, t, None)
    return args, {"pe": model.rope(txt_ids, img_ids)}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `a` against `ref`."""
    return ((a.double() - ref).norm() / ref.norm()).item()


def transformer_parity(rank: int, n: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """For each case (family, heads, dtype, batch, h, w, txt_len, fp8): the sharded forward against this process's
    own unsharded forward (torch.equal, max |diff|) and both against a float64 forward."""
    world, _ = join(ParallelConfig(world_size=n, cfg=False), CPU)
    out = []
    for family, heads, dtype, batch, h, w, txt_len, fp8 in cases:
        model = random_model(family, heads, dtype)
        if fp8:  # e4m3 block projections, activations quantized per token row
            from flux_runtime.weights.fp8 import quantize_model

            quantize_model(model, dtype)
        args, kwargs = inputs(model, batch, h, w, txt_len)
        with torch.no_grad():
            one = model(*args, **kwargs)
            f64 = random_model(family, heads, torch.float64)
            a64, k64 = inputs(f64, batch, h, w, txt_len)
            ref64 = f64(*a64, **k64)
            sharded = SequenceParallel(model, world)
            with world.running(world.plan(cfg=False)):
                many = sharded(*args, **kwargs)
        out.append(
            {
                "case": (family, heads, str(dtype), batch, h, w, txt_len, fp8),
                "equal": torch.equal(one, many),
                "max_diff": _err(one, many),
                "err_one": _rel(one, ref64),
                "err_many": _rel(many, ref64),
                "spans": [sharded_spans(txt_len, h * w, n, r) for r in range(n)],
            }
        )
    return out


def layout_parity(rank: int, n: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """For each case (family, heads, dtype, batch, h, w, txt_len): the sharded forward with each attention-input
    layout (`set_head_major` True, False, "kv") against this process's unsharded forward in the default layout,
    and how the q, k, v that `sdpa` received after the all-to-all were stored: (head-major, contiguous) each."""
    from flux_runtime.kernels.qk_norm_rope import head_major_layout
    from flux_runtime.parallel import ulysses

    world, _ = join(ParallelConfig(world_size=n, cfg=False), CPU)
    seen: list[tuple[tuple[bool, bool], ...]] = []
    library_sdpa = ulysses.sdpa

    def recording_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(tuple((t.permute(0, 2, 1, 3).is_contiguous(), t.is_contiguous()) for t in (q, k, v)))
        return library_sdpa(q, k, v)

    ulysses.sdpa = recording_sdpa
    out = []
    for family, heads, dtype, batch, h, w, txt_len in cases:
        model = random_model(family, heads, dtype)
        args, kwargs = inputs(model, batch, h, w, txt_len)
        with torch.no_grad():
            one = model(*args, **kwargs)
            sharded = SequenceParallel(model, world)
            for layout in (True, False, "kv"):
                seen.clear()
                with head_major_layout(layout), world.running(world.plan(cfg=False)):
                    many = sharded(*args, **kwargs)
                out.append(
                    {"case": (family, layout), "equal": torch.equal(one, many), "seen": sorted(set(seen))}
                )
    return out


def sharded_spans(n_txt: int, n_img: int, n: int, rank: int) -> tuple:
    from flux_runtime.parallel.ulysses import Shards

    s = Shards(n_txt, n_img, n)
    return s.txt_span(rank), s.img_span(rank)


# ---------------------------------------------------------------------- pipelines


def _image(out: Any) -> torch.Tensor | None:
    return None if out.images is None else out.images.clone()


def pipeline_parity(rank: int, n: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run {model, parallel (kwargs of ParallelConfig), call}: the parallel pipeline's image and latents
    (rank 0) against one process's (built in this rank), torch.equal and max |diff|."""
    from flux_runtime.pipeline import Pipeline

    results = []
    single: dict[str, Any] = {}
    parallel: dict[tuple, Any] = {}
    for run in runs:
        name, cfg, call = run["model"], run["parallel"], run["call"]
        key = (name, tuple(sorted(cfg.items())))
        if key not in parallel:
            parallel[key] = Pipeline.from_pretrained(
                name, device="cpu", dtype=torch.float32, parallel=ParallelConfig(world_size=n, **cfg)
            )
        many = parallel[key](**call, output_type="pt")
        entry: dict[str, Any] = {
            "info": many.info.get("parallel"), "images_none": many.images is None, "cache": many.info["cache"]
        }  # fmt: skip
        if rank == 0:
            if name not in single:
                single[name] = Pipeline.from_pretrained(name, device="cpu", dtype=torch.float32)
            one = single[name](**call, output_type="pt")
            entry.update(
                equal=torch.equal(one.images, many.images) and torch.equal(one.latents, many.latents),
                max_diff=_err(one.latents, many.latents),
                text_encoder=parallel[key].text_encoder is not None,
                one_cache=one.info["cache"],
            )
        else:
            entry.update(text_encoder=parallel[key].text_encoder is not None)
        results.append(entry)
    return results


def dies_mid_run(rank: int, n: int, model: str, timeout_s: float) -> dict[str, Any]:
    """Rank 1 kills itself (SIGKILL) at the second denoising step; the others report what they saw."""
    import time

    from flux_runtime.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(
        model, device="cpu", dtype=torch.float32, parallel=ParallelConfig(world_size=n, timeout_s=timeout_s)
    )

    def progress(stage: str, done: int, total: int) -> None:
        if rank == 1 and stage == "denoise" and done == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    start = time.monotonic()
    try:
        pipe("a red circle", width=64, height=64, num_steps=6, progress=progress)
    except Exception as e:  # what the surviving rank raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def stalls(rank: int, n: int, timeout_s: float) -> dict[str, Any]:
    """Rank 1 stops answering (sleeps past the timeout) before a collective; rank 0 must give up."""
    import time

    world, _ = join(ParallelConfig(world_size=n, timeout_s=timeout_s), CPU)
    if rank == 1:
        time.sleep(timeout_s + 6)
        return {"error": None}
    start = time.monotonic()
    try:
        world.broadcast(torch.zeros(4), "a test broadcast")
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def gpu_pipeline(rank: int, n: int, model: str, size: int) -> dict[str, Any]:
    """On n GPUs (NCCL): the bf16 lossless parallel image against one GPU's (rank 0), and what the fused-op
    record says of each run (reference fallbacks by op and reason, failed verifications)."""
    from flux_runtime.kernels import fused_ops_report
    from flux_runtime.pipeline import Pipeline

    prompt = dict(prompt="a red circle on the left", width=size, height=size, num_steps=4, output_type="pt")
    pipe = Pipeline.from_pretrained(model, device="cuda", dtype=torch.bfloat16, parallel=n)
    many = pipe(**prompt)
    report = fused_ops_report()
    out: dict[str, Any] = {
        "parallel": many.info["parallel"],
        "fallbacks": sorted(report.fallbacks),
        "mismatches": list(report.mismatches),
        "fused": sum(report.fused_calls.values()),
    }
    if rank == 0:
        one = Pipeline.from_pretrained(model, device=pipe.device, dtype=torch.bfloat16, cuda_graphs=False)
        ref = one(**prompt)
        out.update(
            one_fallbacks=sorted(fused_ops_report().fallbacks),
            equal=torch.equal(ref.latents, many.latents),
            max_diff=_err(ref.latents, many.latents),
            image_diff=_err(ref.images, many.images),
        )
    return out
