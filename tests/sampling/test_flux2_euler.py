"""`denoise` for FLUX.2 against Flux2Pipeline's per-step code, and the whole sampling path against
Flux2Pipeline / Flux2KleinPipeline.__call__ with tiny diffusers models standing in for ours."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.sampling import (
    FLUX2_SCHEDULE,
    bn_denormalize,
    denoise,
    encode_reference_images,
    flux2_image_ids,
    flux2_pack,
    flux2_prepare_noise,
    flux2_text_ids,
    flux2_unpack,
    get_schedule,
    latent_bn_stats,
    latent_size,
    preprocess_reference_images,
    to_pil_images,
    unpatchify,
)
from tests.flux2_fixtures import TXT_DIM, make_diffusers_flux2
from tests.sampling.diffusers_refs import transformer_model_fn
from tests.sampling.flux2_helpers import (
    MixingDenoiser,
    bare_flux2_pipe,
    bare_klein_pipe,
    diffusers_flux2_loop,
    random_image,
    tiny_flux2_vae,
)

HEIGHT, WIDTH = 64, 48  # 4x3 = 12 image tokens
REF_TOKENS = {0: 0, 1: 20, 2: 26}  # number of reference images → reference tokens (5x4, then + 3x2)


def start(
    batch: int, dtype: torch.dtype, n_refs: int, ref_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    latents = flux2_pack(flux2_prepare_noise(batch, HEIGHT, WIDTH, seed=3, dtype=dtype))
    if n_refs == 0:
        return latents, None
    ref = torch.randn(1, REF_TOKENS[n_refs], 128, generator=torch.Generator().manual_seed(4))
    return latents, ref.to(ref_dtype).repeat(batch, 1, 1)


def ours(model, latents, refs, num_steps, *, model_dtype, guidance=None, negative=None, scale=1.0):
    sigmas, timesteps = get_schedule(num_steps, latents.shape[1], config=FLUX2_SCHEDULE)

    def cast(fn):  # the pipeline's closure: latent_model_input.to(transformer.dtype)
        return None if fn is None else (lambda x, t, g: fn(x.to(model_dtype), t, g))

    return denoise(
        cast(model),
        latents,
        sigmas,
        timesteps,
        guidance=guidance,
        negative_model_fn=cast(negative),
        true_cfg_scale=scale,
        reference_tokens=refs,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["dev", "klein", "klein-cfg"])
@pytest.mark.parametrize("n_refs", [0, 1, 2])
@pytest.mark.parametrize(("batch", "num_steps"), [(1, 4), (2, 7)])
def test_loop_matches_flux2_pipeline(dtype, variant: str, n_refs: int, batch: int, num_steps: int) -> None:
    latents, refs = start(batch, dtype, n_refs, dtype)
    guidance = torch.full([1], 4.0, dtype=torch.float32).expand(batch) if variant == "dev" else None
    cfg = variant == "klein-cfg"
    scale = 4.0 if cfg else 1.0

    def models():
        return MixingDenoiser(128, dtype, seed=1), MixingDenoiser(128, dtype, seed=2) if cfg else None

    pos, neg = models()
    ref = diffusers_flux2_loop(
        num_steps,
        latents,
        pos,
        model_dtype=dtype,
        guidance=guidance,
        image_latents=refs,
        negative=neg,
        guidance_scale=scale,
    )
    pos, neg = models()
    out = ours(pos, latents, refs, num_steps, model_dtype=dtype, guidance=guidance, negative=neg, scale=scale)
    assert out.dtype == dtype and out.shape == latents.shape
    assert torch.equal(out, ref)


def test_dev_50_steps_with_a_reference() -> None:
    """The default dev run length (50 steps), with a reference image."""
    latents, refs = start(1, torch.bfloat16, 1, torch.bfloat16)
    guidance = torch.full([1], 4.0, dtype=torch.float32).expand(1)
    ref = diffusers_flux2_loop(
        50,
        latents,
        MixingDenoiser(128, torch.bfloat16, 1),
        model_dtype=torch.bfloat16,
        guidance=guidance,
        image_latents=refs,
    )
    out = ours(
        MixingDenoiser(128, torch.bfloat16, 1),
        latents,
        refs,
        50,
        model_dtype=torch.bfloat16,
        guidance=guidance,
    )
    assert torch.equal(out, ref)


def test_fp32_reference_tokens_with_a_bf16_model() -> None:
    """A fp32 VAE's reference tokens: cat promotes to fp32, the closure casts to the model's bf16 (as diffusers)."""
    latents, refs = start(2, torch.bfloat16, 2, torch.float32)
    pos, neg = MixingDenoiser(128, torch.bfloat16, 1), MixingDenoiser(128, torch.bfloat16, 2)
    ref = diffusers_flux2_loop(
        5, latents, pos, model_dtype=torch.bfloat16, image_latents=refs, negative=neg, guidance_scale=3.5
    )
    pos, neg = MixingDenoiser(128, torch.bfloat16, 1), MixingDenoiser(128, torch.bfloat16, 2)
    out = ours(pos, latents, refs, 5, model_dtype=torch.bfloat16, negative=neg, scale=3.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def test_reference_tokens_condition_but_are_not_updated() -> None:
    latents, refs = start(2, torch.bfloat16, 2, torch.bfloat16)
    assert refs is not None
    model = MixingDenoiser(128, torch.bfloat16, 1)
    out = ours(model, latents, refs, 4, model_dtype=torch.bfloat16)
    assert len(model.inputs) == 4
    for x in model.inputs:  # every step: current latents first, then the same reference tokens
        assert x.shape == (2, 12 + 26, 128)
        assert torch.equal(x[:, 12:], refs)
    assert torch.equal(model.inputs[0][:, :12], latents)
    assert not torch.equal(model.inputs[1][:, :12], latents)
    without = ours(MixingDenoiser(128, torch.bfloat16, 1), latents, None, 4, model_dtype=torch.bfloat16)
    assert not torch.equal(out, without)


def test_klein_cfg_changes_the_result() -> None:
    latents, refs = start(1, torch.bfloat16, 1, torch.bfloat16)
    pos = MixingDenoiser(128, torch.bfloat16, 1)
    cond_only = ours(pos, latents, refs, 4, model_dtype=torch.bfloat16)
    cfg = ours(
        pos,
        latents,
        refs,
        4,
        model_dtype=torch.bfloat16,
        negative=MixingDenoiser(128, torch.bfloat16, 2),
        scale=4.0,
    )
    assert not torch.equal(cfg, cond_only)


def test_reference_errors() -> None:
    latents, refs = start(2, torch.float32, 1, torch.float32)
    sigmas, timesteps = get_schedule(2, 12, config=FLUX2_SCHEDULE)
    identity = lambda x, t, g: x  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"expected reference_tokens \(B, L_ref, C\) = \(2, L_ref, 128\), got shape \(1, 20, 128\)",
    ):
        denoise(identity, latents, sigmas, timesteps, reference_tokens=refs[:1])
    with pytest.raises(ValueError, match=r"got shape \(2, 20, 64\)"):
        denoise(identity, latents, sigmas, timesteps, reference_tokens=refs[..., :64])
    with pytest.raises(ValueError, match=r"model_fn returned shape \(2, 12, 128\), expected \(2, 32, 128\)"):
        denoise(lambda x, t, g: x[:, :12], latents, sigmas, timesteps, reference_tokens=refs)


# ---- end to end: the diffusers pipelines' __call__ with tiny random diffusers models ------------------------

TXT_LEN = 8


def sample_ours(transformer, vae, embeds, neg_embeds, images, *, steps, seed, guidance_scale, dev, cfg):
    """Our sampling functions in Flux2Pipeline's order, the diffusers models standing in for ours."""
    batch = embeds.shape[0]
    h, w = latent_size(HEIGHT, WIDTH)
    mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
    latents = flux2_pack(flux2_prepare_noise(batch, HEIGHT, WIDTH, seed=seed, dtype=embeds.dtype))
    img_ids, ref_tokens = flux2_image_ids(h, w), None
    if images:
        refs = preprocess_reference_images(images)
        ref_tokens, ref_ids = encode_reference_images(
            refs, lambda x: vae.encode(x).latent_dist.mode(), mean, std, batch=batch, dtype=vae.dtype
        )
        img_ids = torch.cat([img_ids, ref_ids])

    def model_fn_for(txt):
        return transformer_model_fn(transformer, txt, flux2_text_ids(txt.shape[1]), img_ids, cast=True)

    guidance = torch.full([1], guidance_scale, dtype=torch.float32).expand(batch) if dev else None
    sigmas, timesteps = get_schedule(steps, latents.shape[1], config=FLUX2_SCHEDULE)
    out = denoise(
        model_fn_for(embeds),
        latents,
        sigmas,
        timesteps,
        guidance=guidance,
        negative_model_fn=model_fn_for(neg_embeds) if cfg else None,
        true_cfg_scale=guidance_scale if cfg else 1.0,
        reference_tokens=ref_tokens,
    )
    z = unpatchify(bn_denormalize(flux2_unpack(out, h, w), mean, std))  # (B, 32, h, w), the decoder's input
    return out, z


def assert_same_images(ours_pil, ref_pil, batch: int) -> None:
    assert len(ours_pil) == len(ref_pil) == batch
    for a, b in zip(ours_pil, ref_pil, strict=True):
        assert a.size == b.size == (WIDTH, HEIGHT)
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert len(np.unique(np.asarray(a))) > 10  # a real image, not a constant one


def pipeline_images(pipe, output_type: str, seed: int, **call):
    """`pipe(**call)`'s output at HEIGHT x WIDTH, 3 steps, drawn from a CPU generator seeded `seed`."""
    generator = torch.Generator().manual_seed(seed)
    run = dict(
        height=HEIGHT, width=WIDTH, num_inference_steps=3, generator=generator, output_type=output_type
    )
    return pipe(**call, **run).images


def embeddings(batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randn(batch, TXT_LEN, TXT_DIM, generator=gen).to(torch.bfloat16)
    neg = torch.randn(batch, TXT_LEN, TXT_DIM, generator=gen).to(torch.bfloat16)
    return pos, neg


@pytest.mark.parametrize(("batch", "n_refs"), [(1, 0), (2, 1)])
def test_matches_flux2_pipeline_end_to_end(batch: int, n_refs: int) -> None:
    """dev: noise → references → schedule → loop with guidance → unpack → BN → unpatchify → decode → PIL."""
    transformer = make_diffusers_flux2(guidance=True).to(torch.bfloat16)
    vae = tiny_flux2_vae(torch.bfloat16)
    pipe = bare_flux2_pipe(vae, transformer)
    embeds, _ = embeddings(batch, seed=5)
    images = [random_image(80, 72, seed=9)][:n_refs]
    common = dict(image=images or None, prompt_embeds=embeds, guidance_scale=4.0)
    ref_latents = pipeline_images(pipe, "latent", 11, **common)
    ref_pil = pipeline_images(pipe, "pil", 11, **common)

    with torch.no_grad():
        out, z = sample_ours(
            transformer, vae, embeds, None, images, steps=3, seed=11, guidance_scale=4.0, dev=True, cfg=False
        )
        assert torch.equal(out, ref_latents)
        pil = to_pil_images(vae.decode(z, return_dict=False)[0])
    assert_same_images(pil, ref_pil, batch)


@pytest.mark.parametrize(
    ("distilled", "n_refs", "vae_dtype"),
    [(False, 2, torch.bfloat16), (True, 1, torch.bfloat16), (False, 1, torch.float32)],
)
def test_matches_klein_pipeline_end_to_end(distilled: bool, n_refs: int, vae_dtype) -> None:
    """klein: no guidance embedding; base models run CFG with the negative embeddings, distilled ones do not."""
    transformer = make_diffusers_flux2(guidance=False).to(torch.bfloat16)
    vae = tiny_flux2_vae(vae_dtype)
    pipe = bare_klein_pipe(vae=vae, transformer=transformer, is_distilled=distilled)
    batch = 2
    embeds, neg_embeds = embeddings(batch, seed=6)
    images = [random_image(80, 72, seed=9), random_image(64, 100, seed=10)][:n_refs]
    common = dict(image=images, prompt_embeds=embeds, negative_prompt_embeds=neg_embeds, guidance_scale=3.0)
    # klein's "latent" output is already BN-denormalized and unpatchified: the decoder's input
    ref_z = pipeline_images(pipe, "latent", 12, **common)

    with torch.no_grad():
        _, z = sample_ours(
            transformer,
            vae,
            embeds,
            neg_embeds,
            images,
            steps=3,
            seed=12,
            guidance_scale=3.0,
            dev=False,
            cfg=not distilled,
        )
        assert torch.equal(z, ref_z)
        if vae_dtype == torch.bfloat16:  # diffusers decodes in the latents' dtype: needs a bf16 VAE
            ref_pil = pipeline_images(pipe, "pil", 12, **common)
            assert_same_images(to_pil_images(vae.decode(z, return_dict=False)[0]), ref_pil, batch)
