#!/usr/bin/env python3
"""FLUX.1 Redux's image encoding on the GPU, ours beside diffusers' (random weights at full size, bf16).

SigLIP so400m-patch14-384 (transformers' `SiglipVisionModel`, which both sides run) and the Redux embedder
(4096 x 3 wide), one 1024² image: the time from a PIL image to the Redux tokens (preprocess, SigLIP, embedder)
through our `Redux.embed`, and through diffusers' `FluxPriorReduxPipeline.encode_image` + `image_embedder`, with
the tokens compared (`torch.equal`). Usage: python3 scripts/bench_redux.py [--iters 10] [--json out.json].
Never a test: quote the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import DEV, cuda_time, finish_run, require_cuda  # scripts/benchlib.py, beside this file

SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=384, patch_size=14)  # fmt: skip


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not require_cuda("bench_redux.py"):
        return 0
    from diffusers.pipelines.flux.modeling_flux import ReduxImageEncoder
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    from flux_runtime.models.redux import ReduxConfig, ReduxEmbedder
    from flux_runtime.text.siglip import SiglipImageEncoder

    t0 = time.perf_counter()
    torch.manual_seed(0)
    siglip = SiglipVisionModel(SiglipVisionConfig(**SO400M)).to(DEV, torch.bfloat16).eval()
    processor = SiglipImageProcessor(size={"height": 384, "width": 384}, resample=3)
    theirs = ReduxImageEncoder().to(DEV, torch.bfloat16).eval()
    ours_embedder = ReduxEmbedder(ReduxConfig()).to(DEV, torch.bfloat16).eval()
    ours_embedder.load_state_dict(theirs.state_dict())
    encoder = SiglipImageEncoder(siglip, processor)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, size=(1024, 1024, 3), dtype=np.uint8))

    def diffusers_encode() -> torch.Tensor:  # FluxPriorReduxPipeline.encode_image, then its embedder
        features = processor.preprocess(
            images=[image], do_resize=True, return_tensors="pt", do_convert_rgb=True
        )
        features = features.to(device=DEV, dtype=torch.bfloat16)
        return theirs(siglip(**features).last_hidden_state).image_embeds

    def ours_encode() -> torch.Tensor:  # what `Redux.embed` runs
        return ours_embedder(encoder.encode([image], torch.device(DEV)))

    equal = torch.equal(ours_encode(), diffusers_encode())
    # CUDA events around the whole call: the host's preprocessing, before the first kernel, counts too
    ms = {
        "diffusers": cuda_time(diffusers_encode, iters=args.iters),
        "ours": cuda_time(ours_encode, iters=args.iters),
    }
    print("| Redux image encoding, one 1024² image, bf16 | ms | / diffusers | torch.equal |")
    print("|---|---|---|---|")
    for name, value in ms.items():
        print(f"| {name} | {value:.1f} | {value / ms['diffusers']:.2f} | {equal if name == 'ours' else ''} |")
    finish_run({"ms": ms, "equal": equal}, t0, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
