"""End-to-end FLUX.1-dev generation at full size with random weights: ours vs diffusers FluxPipeline.

Called by bench.py with the two transformers it built. Builds full-size CLIP-L and T5-XXL (random,
transformers classes on `memory_trace`'s configs, the tiny shipped tokenizers: token ids stay inside the
real vocabularies) and the FLUX.1 VAE in both implementations with the same weights, then times a 1024²,
50-step generation.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from benchlib import DEV, diffusers_vae_kwargs  # scripts/benchlib.py, beside this file

from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.memory_trace import clip_l_config, t5_xxl_config
from flux_runtime.sampling import FLUX1_DEV_SCHEDULE
from flux_runtime.text import Flux1TextEncoder
from flux_runtime.text.tokenizers import load_clip_tokenizer, load_t5_tokenizer, tiny_tokenizer_path
from flux_runtime.weights import vae_layout

BF = torch.bfloat16
PROMPT = "a red fox in the snow, golden hour, photograph"


def _text_encoders():
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(2)
    with torch.device(DEV):
        clip = CLIPTextModel(clip_l_config()).to(BF).eval()
        t5 = T5EncoderModel(t5_xxl_config()).to(BF).eval()
    return (
        clip,
        load_clip_tokenizer(tiny_tokenizer_path("clip")),
        t5,
        load_t5_tokenizer(tiny_tokenizer_path("t5")),
    )


def _vaes():
    from diffusers import AutoencoderKL

    torch.manual_seed(3)
    with torch.device(DEV):
        ref = AutoencoderKL(**diffusers_vae_kwargs(FLUX1_VAE)).to(BF).eval()
    sd = ref.state_dict()
    rules = list(vae_layout.rules(FLUX1_VAE.ch_mult, FLUX1_VAE.num_res_blocks))
    with torch.device("meta"):
        ours = Flux1VAE(FLUX1_VAE)
    ours.load_state_dict(
        {r.bfl: vae_layout.diffusers_to_bfl(r, sd[r.diffusers]) for r in rules}, strict=True, assign=True
    )
    return ref, ours.eval()


def _timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000
    work_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    return out, ms, work_gib


@torch.no_grad()
def bench_pipeline(ref_dit, ours_dit, steps: int, results: dict) -> None:
    from diffusers import FluxPipeline

    from tests.sampling.diffusers_refs import DEV_SCHEDULER_CONFIG, diffusers_pipeline

    clip, clip_tok, t5, t5_tok = _text_encoders()
    ref_vae, ours_vae = _vaes()
    ref = diffusers_pipeline(  # on FLUX.1-dev's scheduler config, progress bar off
        FluxPipeline, DEV_SCHEDULER_CONFIG, vae=ref_vae, text_encoder=clip, tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=ref_dit,
    )  # fmt: skip
    text = Flux1TextEncoder(clip, clip_tok, t5, t5_tok)
    variants = {
        "ours lossless + CUDA graphs": Pipeline(
            ours_dit, ours_vae, text, schedule=FLUX1_DEV_SCHEDULE, quality="lossless"
        ),
        "ours lossless eager": Pipeline(
            ours_dit, ours_vae, text, schedule=FLUX1_DEV_SCHEDULE, quality="lossless", cuda_graphs=False
        ),
        "ours high + CUDA graphs": Pipeline(
            ours_dit, ours_vae, text, schedule=FLUX1_DEV_SCHEDULE, quality="high"
        ),
    }
    kw = dict(height=1024, width=1024)

    def run_ref(output_type, n=steps):
        return ref(
            PROMPT,
            num_inference_steps=n,
            guidance_scale=3.5,
            generator=torch.Generator().manual_seed(0),
            output_type=output_type,
            **kw,
        ).images

    def run_ours(pipe, output_type, n=steps):
        out = pipe(PROMPT, num_steps=n, guidance=3.5, seed=0, output_type=output_type, **kw)
        return out.images if output_type != "latent" else out.latents

    # warm-up (cuDNN/cuBLAS plans, Triton compiles, first graph capture)
    run_ref("latent", 2)
    for pipe in variants.values():
        run_ours(pipe, "latent", 2)

    rows = {}
    ref_lat, ms_lat, mem = _timed(lambda: run_ref("latent"))
    ref_img, ms_img, mem_img = _timed(lambda: run_ref("pil"))
    rows["diffusers FluxPipeline"] = (ms_lat, ms_img, max(mem, mem_img), "")
    equal = {}
    for name, pipe in variants.items():
        lat, o_lat, m1 = _timed(lambda pipe=pipe: run_ours(pipe, "latent"))
        img, o_img, m2 = _timed(lambda pipe=pipe: run_ours(pipe, "pil"))
        same_lat = torch.equal(lat, ref_lat)
        same_img = all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(img, ref_img, strict=True)
        )
        if "high" in name:
            diff = np.asarray(img[0]).astype(np.float64) - np.asarray(ref_img[0]).astype(np.float64)
            mse = float((diff**2).mean())
            verdict = f"PSNR vs diffusers {10 * np.log10(255**2 / mse):.1f} dB" if mse else "identical"
        else:
            verdict = f"latents equal {same_lat}, image equal {same_img}"
            equal[name] = same_lat and same_img
        rows[name] = (o_lat, o_img, max(m1, m2), verdict)

    results["pipeline_equal"] = all(equal.values())
    results["pipeline_ms"] = {
        k: {"encode_denoise": v[0], "end_to_end": v[1], "working_gib": v[2], "note": v[3]}
        for k, v in rows.items()
    }
    ref_e2e = rows["diffusers FluxPipeline"][1]
    print()
    print(
        f"| FLUX.1-dev, 1024², {steps} steps, bf16, B=1 | encode+denoise ms | end-to-end ms | / diffusers "
        "| working GiB above weights | parity |"
    )
    print("|---|---|---|---|---|---|")
    for name, (a, b, m, v) in rows.items():
        print(f"| {name} | {a:.0f} | {b:.0f} | {b / ref_e2e:.2f} | {m:.1f} | {v} |")
