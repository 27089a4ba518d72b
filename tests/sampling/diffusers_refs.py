"""diffusers' side of the FLUX.1 and FLUX.2 sampling tests: the FLUX.1 repos' scheduler configs, diffusers
pipelines holding only the models a test gives, a diffusers transformer as `denoise`'s model_fn, and the noise
checks against the pipelines' `prepare_latents`."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from flux_runtime.sampling import FLUX1_DEV_SCHEDULE, FLUX1_SCHNELL_SCHEDULE

CPU = torch.device("cpu")

# scheduler/scheduler_config.json of the two FLUX.1 repos, written out independently of our presets; FLUX.2's
# pipelines run the dev one (dynamic shifting on, mu passed by the pipeline).
DEV_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    base_shift=0.5,
    max_shift=1.15,
)
SCHNELL_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
# FLUX.1 variant -> (its repo's scheduler config, our preset)
FLUX1_VARIANTS = {
    "dev": (DEV_SCHEDULER_CONFIG, FLUX1_DEV_SCHEDULE),
    "schnell": (SCHNELL_SCHEDULER_CONFIG, FLUX1_SCHNELL_SCHEDULE),
}

# (height, width) in pixels of the latent tests; non-square both ways
SIZES = [(256, 128), (128, 256), (512, 512), (1024, 768)]


def diffusers_pipeline(
    cls: type[DiffusionPipeline], scheduler_config: dict | None = None, **given: object
) -> DiffusionPipeline:
    """A diffusers `cls` on `FlowMatchEulerDiscreteScheduler(**scheduler_config)` with the components and
    options `given` (the models a test runs, `is_distilled`), None for every other component it requires,
    and its progress bar off."""
    params = inspect.signature(cls.__init__).parameters
    required = [n for n, p in params.items() if n not in ("self", "scheduler") and p.default is p.empty]
    scheduler = FlowMatchEulerDiscreteScheduler(**(scheduler_config or {}))
    pipe = cls(scheduler=scheduler, **{**dict.fromkeys(required), **given})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def transformer_model_fn(transformer, txt, txt_ids, img_ids, cast: bool = False, **fixed: object):
    """The diffusers `transformer` standing in for ours as `denoise`'s `model_fn(x, t, guidance)`, on the text
    states `txt` and the `fixed` keywords (FLUX.1's `pooled_projections`); `cast`: x to the transformer's dtype
    first, as FLUX.2's pipelines do."""

    def model_fn(x: torch.Tensor, t: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        return transformer(
            hidden_states=x.to(transformer.dtype) if cast else x, timestep=t, guidance=g,
            encoder_hidden_states=txt, txt_ids=txt_ids, img_ids=img_ids, return_dict=False, **fixed,
        )[0]  # fmt: skip

    return model_fn


def noise_matches_prepare_latents(
    pipe, channels: int, prepare: Callable[..., torch.Tensor], pack: Callable[[torch.Tensor], torch.Tensor],
    batch: int, height: int, width: int, dtype: torch.dtype, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`prepare(batch, height, width, seed=seed, dtype=dtype)` packed by `pack` is `pipe.prepare_latents`'
    latents of `channels` channels from a CPU generator seeded `seed`, and a generator of that seed draws
    the same noise. Returns (our noise, diffusers' latents, diffusers' ids) for the family's own checks."""
    ref, ref_ids = pipe.prepare_latents(
        batch, channels, height, width, dtype, CPU, torch.Generator("cpu").manual_seed(seed)
    )
    noise = prepare(batch, height, width, seed=seed, dtype=dtype)
    assert noise.dtype == dtype
    assert torch.equal(pack(noise), ref)
    from_generator = prepare(
        batch, height, width, generator=torch.Generator("cpu").manual_seed(seed), dtype=dtype
    )
    assert torch.equal(from_generator, noise)
    return noise, ref, ref_ids


def generator_list_matches_prepare_latents(
    pipe, channels: int, prepare: Callable[..., torch.Tensor], pack: Callable[[torch.Tensor], torch.Tensor],
    seeds: list[int],
) -> None:  # fmt: skip
    """A list of generators draws `pipe.prepare_latents`' bf16 noise of a 256 x 384 batch, one image per
    generator, and image k equals a batch of one drawn from seed k."""
    ref, _ = pipe.prepare_latents(
        len(seeds), channels, 256, 384, torch.bfloat16, CPU, [torch.Generator().manual_seed(s) for s in seeds]
    )
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    ours = prepare(len(seeds), 256, 384, generator=generators, dtype=torch.bfloat16)
    assert torch.equal(pack(ours), ref)
    for k, s in enumerate(seeds):
        assert torch.equal(ours[k : k + 1], prepare(1, 256, 384, seed=s, dtype=torch.bfloat16))
