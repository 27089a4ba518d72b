"""Tiny random FLUX.1 Redux made by diffusers and transformers, in the layouts people hold.

A SigLIP vision tower of 2 layers at 32 px (16 patches of 8 px), its image processor with
FLUX.1-Redux-dev's settings at that size, and a `ReduxImageEncoder`, written as the diffusers folder
(`image_embedder/`, `image_encoder/`, `feature_extractor/`) and as BFL's single file beside a SigLIP folder.
"""

from __future__ import annotations

from pathlib import Path

from tests.random_models import randomised, save_tensors

SIGLIP_KW = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
IMAGE_TOKENS = (32 // 8) ** 2


def make_siglip(seed: int = 7):
    """A tiny `SiglipVisionModel` (every weight moved off its init) and its `SiglipImageProcessor`."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    model = randomised(lambda **kw: SiglipVisionModel(SiglipVisionConfig(**kw)), seed, **SIGLIP_KW)
    # FLUX.1-Redux-dev's feature_extractor at the tiny size: bicubic resize, rescale, normalise by 0.5 / 0.5
    processor = SiglipImageProcessor(
        do_resize=True,
        size={"height": 32, "width": 32},
        resample=3,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return model, processor


def make_embedder(txt_width: int, seed: int = 11):
    """A `ReduxImageEncoder` reading the tiny SigLIP's states, giving tokens `txt_width` wide."""
    from diffusers.pipelines.flux.modeling_flux import ReduxImageEncoder

    return randomised(ReduxImageEncoder, seed, redux_dim=SIGLIP_KW["hidden_size"], txt_in_features=txt_width)


def save_redux(folder: Path, txt_width: int) -> Path:
    """The diffusers layout (a FluxPriorReduxPipeline saved without text encoders), as FLUX.1-Redux-dev."""
    from diffusers import FluxPriorReduxPipeline

    encoder, processor = make_siglip()
    FluxPriorReduxPipeline(
        image_encoder=encoder, feature_extractor=processor, image_embedder=make_embedder(txt_width)
    ).save_pretrained(folder)
    return folder


def save_bfl_redux(path: Path, txt_width: int, seed: int = 11) -> Path:
    """BFL's single file: the embedder's four tensors under their own names."""
    sd = make_embedder(txt_width, seed).state_dict()
    return save_tensors({k: v.contiguous() for k, v in sd.items()}, path)


def save_whole_siglip(folder: Path) -> Path:
    """`make_siglip`'s vision tower inside a whole SigLIP (with a text half), its processor beside it: the
    layout of google/siglip-so400m-patch14-384, the SigLIP BFL's single file is used with."""
    from transformers import SiglipConfig, SiglipModel

    vision, processor = make_siglip()
    text = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    whole = SiglipModel(SiglipConfig(vision_config=vision.config.to_dict(), text_config=text))
    whole.vision_model.load_state_dict(vision.state_dict())
    whole.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
