"""`denoise` against diffusers: the scheduler's `step` driven like FluxPipeline, and FluxPipeline.__call__ itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from flux_runtime.sampling import (
    FLUX1_DEV_SCHEDULE,
    FLUX1_SCHNELL_SCHEDULE,
    denoise,
    denormalize_latents,
    get_schedule,
    image_ids,
    latent_size,
    pack,
    prepare_noise,
    to_pil_images,
    unpack,
)
from tests.flux1_fixtures import make_diffusers_transformer
from tests.sampling.diffusers_refs import (
    DEV_SCHEDULER_CONFIG,
    FLUX1_VARIANTS,
    diffusers_pipeline,
    transformer_model_fn,
)
from tests.weights.vae_fixtures import make_diffusers_vae


class FakeDenoiser:
    """A fixed random affine map of latents, timestep and guidance, computed in the latents' dtype.

    Records the timesteps it is called with, so tests can see the bf16-rounded `t / 1000`.
    """

    def __init__(self, channels: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weight = (torch.randn(channels, channels, generator=gen) / channels**0.5).to(dtype)
        self.t_dir = torch.randn(channels, generator=gen).to(dtype)
        self.g_dir = (0.1 * torch.randn(channels, generator=gen)).to(dtype)
        self.timesteps: list[torch.Tensor] = []

    def __call__(
        self, latents: torch.Tensor, timestep: torch.Tensor, guidance: torch.Tensor | None
    ) -> torch.Tensor:
        self.timesteps.append(timestep)
        out = latents @ self.weight + timestep[:, None, None] * self.t_dir
        if guidance is not None:
            out = out + guidance.to(latents.dtype)[:, None, None] * self.g_dir
        return out


def diffusers_loop(config, num_steps, latents, model_fn, guidance=None, negative_fn=None, true_cfg_scale=1.0):
    """FluxPipeline.__call__'s steps 5 and 6 with `model_fn` for the transformer and diffusers' scheduler."""
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(latents.shape[1])
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, latents.device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    for t in timesteps:
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        noise_pred = model_fn(latents, timestep / 1000, guidance)
        if negative_fn is not None:
            neg_noise_pred = negative_fn(latents, timestep / 1000, guidance)
            noise_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
    return latents


def start_latents(batch: int, height: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return pack(prepare_noise(batch, height, width, seed=seed, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize(("batch", "num_steps"), [(1, 28), (2, 4), (1, 1)])
def test_loop_matches_scheduler_step(dtype, variant: str, batch: int, num_steps: int) -> None:
    diffusers_config, config = FLUX1_VARIANTS[variant]
    latents = start_latents(batch, 256, 128, dtype)
    guidance = torch.full([1], 3.5, dtype=torch.float32).expand(batch) if variant == "dev" else None
    model = FakeDenoiser(64, dtype, seed=1)

    ref = diffusers_loop(diffusers_config, num_steps, latents, model, guidance)
    sigmas, timesteps = get_schedule(num_steps, latents.shape[1], config=config)
    ours = denoise(model, latents, sigmas, timesteps, guidance=guidance)
    assert ours.dtype == dtype and ours.shape == latents.shape
    assert torch.equal(ours, ref)


def test_bf16_roundings_are_visible() -> None:
    """The fake model is sensitive enough that an fp32 `dt * pred` or fp32 `t / 1000` would change the bits."""
    dtype, batch, num_steps = torch.bfloat16, 1, 28
    latents = start_latents(batch, 256, 128, dtype)
    model = FakeDenoiser(64, dtype, seed=1)
    sigmas, timesteps = get_schedule(num_steps, latents.shape[1], config=FLUX1_DEV_SCHEDULE)
    exact = denoise(model, latents, sigmas, timesteps)

    x = latents
    for i, t in enumerate(timesteps):
        pred = model(x, (t / 1000).expand(batch).to(dtype), None)  # no bf16 rounding of t before / 1000
        x = (x.float() + (sigmas[i + 1] - sigmas[i]) * pred).to(dtype)
    assert not torch.equal(x, exact)

    x = latents
    for i, t in enumerate(timesteps):
        pred = model(x, t.expand(batch).to(dtype) / 1000, None)
        x = (x.float() + (sigmas[i + 1] - sigmas[i]) * pred.float()).to(dtype)  # fp32 dt * pred
    assert not torch.equal(x, exact)


def test_model_sees_bf16_rounded_timesteps() -> None:
    """diffusers: t = 988.40863 → bf16 988.0 → / 1000 in bf16 → 0.98828125."""
    latents = start_latents(2, 1024, 1024, torch.bfloat16)[:, :16]  # 4096-token schedule, few tokens to run
    model = FakeDenoiser(64, torch.bfloat16, seed=0)
    sigmas, timesteps = get_schedule(28, 4096, config=FLUX1_DEV_SCHEDULE)
    denoise(model, latents, sigmas, timesteps)
    assert len(model.timesteps) == 28
    first, second = model.timesteps[0], model.timesteps[1]
    assert first.dtype == torch.bfloat16 and first.shape == (2,)
    assert first.tolist() == [1.0, 1.0]
    assert second.tolist() == [0.98828125, 0.98828125]


def test_true_cfg_matches_diffusers() -> None:
    dtype = torch.bfloat16
    latents = start_latents(2, 128, 256, dtype)
    guidance = torch.full([1], 3.5, dtype=torch.float32).expand(2)
    pos, neg = FakeDenoiser(64, dtype, seed=1), FakeDenoiser(64, dtype, seed=2)
    ref = diffusers_loop(DEV_SCHEDULER_CONFIG, 8, latents, pos, guidance, negative_fn=neg, true_cfg_scale=4.0)
    sigmas, timesteps = get_schedule(8, latents.shape[1], config=FLUX1_DEV_SCHEDULE)
    ours = denoise(
        pos, latents, sigmas, timesteps, guidance=guidance, negative_model_fn=neg, true_cfg_scale=4.0
    )
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, denoise(pos, latents, sigmas, timesteps, guidance=guidance))


def test_callback_sees_every_step() -> None:
    latents = start_latents(1, 128, 128, torch.float32)
    sigmas, timesteps = get_schedule(4, latents.shape[1], config=FLUX1_SCHNELL_SCHEDULE)
    seen: list[tuple[int, float, torch.Tensor]] = []
    out = denoise(
        FakeDenoiser(64, torch.float32, seed=0),
        latents,
        sigmas,
        timesteps,
        callback=lambda i, t, x: seen.append((i, t.item(), x)),
    )
    assert [(i, t) for i, t, _ in seen] == [(0, 1000.0), (1, 750.0), (2, 500.0), (3, 250.0)]
    assert torch.equal(seen[-1][2], out)
    assert not torch.equal(seen[0][2], out)


def test_schedule_is_moved_to_the_latents_device() -> None:
    latents = torch.zeros(1, 4, 64, device="meta", dtype=torch.bfloat16)
    sigmas, timesteps = get_schedule(2, 4, config=FLUX1_DEV_SCHEDULE)  # on the CPU
    devices = []

    def model_fn(x, t, g):
        devices.append(t.device.type)
        return x

    out = denoise(model_fn, latents, sigmas, timesteps)
    assert devices == ["meta", "meta"] and out.device.type == "meta"


def test_errors() -> None:
    latents = torch.zeros(1, 4, 64)
    sigmas, timesteps = get_schedule(2, 4, config=FLUX1_DEV_SCHEDULE)
    identity = lambda x, t, g: x  # noqa: E731
    with pytest.raises(ValueError, match=r"expected packed latents \(B, L, C\), got shape \(4, 64\)"):
        denoise(identity, latents[0], sigmas, timesteps)
    with pytest.raises(
        ValueError, match=r"expected sigmas \(N \+ 1,\) and timesteps \(N,\), got \(2,\) and \(2,\)"
    ):
        denoise(identity, latents, sigmas[:2], timesteps)
    with pytest.raises(
        ValueError, match=r"sigmas and timesteps must be fp32, got torch\.float64 and torch\.float32"
    ):
        denoise(identity, latents, sigmas.double(), timesteps)
    with pytest.raises(ValueError, match=r"model_fn returned shape \(1, 4, 32\), expected \(1, 4, 64\)"):
        denoise(lambda x, t, g: x[..., :32], latents, sigmas, timesteps)
    with pytest.raises(ValueError, match=r"true_cfg_scale 4\.0 needs a negative_model_fn"):
        denoise(identity, latents, sigmas, timesteps, true_cfg_scale=4.0)
    with pytest.raises(ValueError, match=r"true_cfg_scale 1\.0 must be > 1 with a negative_model_fn"):
        denoise(identity, latents, sigmas, timesteps, negative_model_fn=identity)


# ---- end to end: FluxPipeline.__call__ with tiny random diffusers models ----------------------------------------

TXT_LEN, TXT_DIM, POOLED_DIM = 8, 32, 32


def tiny_transformer(guidance: bool):
    """One double and one single block of 2 x 16 heads, every weight moved off its init (zero-initialised
    output layers would make the prediction trivial), in bf16."""
    model = make_diffusers_transformer(
        guidance, num_layers=1, num_single_layers=1, attention_head_dim=16, axes_dims_rope=(4, 6, 6),
        joint_attention_dim=TXT_DIM, pooled_projection_dim=POOLED_DIM,
    )  # fmt: skip
    return model.to(torch.bfloat16)


def tiny_vae():
    """A 4-level (8x) FLUX.1 autoencoder of width 8, in bf16."""
    return make_diffusers_vae(2, block_out_channels=(8, 8, 8, 8), norm_num_groups=4).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("variant", "batch", "true_cfg_scale"), [("dev", 1, 1.0), ("dev", 2, 4.0), ("schnell", 2, 1.0)]
)
def test_matches_flux_pipeline_end_to_end(variant: str, batch: int, true_cfg_scale: float) -> None:
    """Noise → schedule → loop → unpack → denormalize → (diffusers) VAE → PIL, equal to FluxPipeline's images."""
    diffusers_config, config = FLUX1_VARIANTS[variant]
    height, width, num_steps, seed, dtype = 64, 32, 4, 42, torch.bfloat16
    transformer, vae = tiny_transformer(guidance=variant == "dev"), tiny_vae()
    pipe = diffusers_pipeline(FluxPipeline, diffusers_config, vae=vae, transformer=transformer)
    gen = torch.Generator().manual_seed(7)
    embeds = torch.randn(batch, TXT_LEN, TXT_DIM, generator=gen).to(dtype)
    pooled = torch.randn(batch, POOLED_DIM, generator=gen).to(dtype)
    neg_embeds = torch.randn(batch, TXT_LEN, TXT_DIM, generator=gen).to(dtype)
    neg_pooled = torch.randn(batch, POOLED_DIM, generator=gen).to(dtype)
    cfg = true_cfg_scale > 1

    common = dict(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=neg_embeds if cfg else None,
        negative_pooled_prompt_embeds=neg_pooled if cfg else None,
        true_cfg_scale=true_cfg_scale,
        height=height,
        width=width,
        num_inference_steps=num_steps,
        guidance_scale=3.5,
    )
    ref_latents = pipe(**common, generator=torch.Generator().manual_seed(seed), output_type="latent").images
    ref_images = pipe(**common, generator=torch.Generator().manual_seed(seed), output_type="pil").images

    # ours, with the diffusers transformer and VAE standing in for the pipeline's models
    h, w = latent_size(height, width)
    latents = pack(prepare_noise(batch, height, width, seed=seed, dtype=dtype))
    img_ids = image_ids(h, w, dtype=dtype)
    txt_ids = torch.zeros(TXT_LEN, 3, dtype=dtype)

    def model_fn_for(txt: torch.Tensor, vec: torch.Tensor):
        return transformer_model_fn(transformer, txt, txt_ids, img_ids, pooled_projections=vec)

    guidance = torch.full([1], 3.5, dtype=torch.float32).expand(batch) if variant == "dev" else None
    sigmas, timesteps = get_schedule(num_steps, latents.shape[1], config=config)
    with torch.no_grad():
        out = denoise(
            model_fn_for(embeds, pooled),
            latents,
            sigmas,
            timesteps,
            guidance=guidance,
            negative_model_fn=model_fn_for(neg_embeds, neg_pooled) if cfg else None,
            true_cfg_scale=true_cfg_scale,
        )
        assert torch.equal(out, ref_latents)
        z = denormalize_latents(unpack(out, h, w), vae.config.scaling_factor, vae.config.shift_factor)
        images = to_pil_images(vae.decode(z, return_dict=False)[0])

    assert len(images) == len(ref_images) == batch
    for ours, ref in zip(images, ref_images, strict=True):
        assert ours.size == ref.size == (width, height) and ours.mode == ref.mode == "RGB"
        ours_np = np.asarray(ours)
        assert np.array_equal(ours_np, np.asarray(ref))
        assert len(np.unique(ours_np)) > 10  # a real image, not a saturated or constant one
