"""Fixtures of the FLUX.2 text-encoder tests (test_flux2_text.py, test_flux2_text_errors.py).

diffusers opens a [dev] `tokenizer/` folder with transformers' PixtralProcessor, whose module imports torchvision
for image resizing; torchvision is no dependency of ours, and without it `transformers.PixtralProcessor` is a
placeholder. The `pixtral` fixture then imports the real class with that one image-only helper module stubbed
and registers it on `transformers`, so diffusers runs the genuine processor code on text prompts.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def pixtral() -> Iterator[type]:
    """transformers' PixtralProcessor class, usable by diffusers with or without torchvision installed."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        import transformers

        yield transformers.PixtralProcessor
        return

    def images_only(*args: object, **kwargs: object) -> None:
        raise AssertionError("the FLUX.2 text tests never process images")

    helper = "transformers.models.pixtral.image_processing_pixtral"
    stub = types.ModuleType(helper)
    stub.get_resize_output_image_size = images_only  # type: ignore[attr-defined]
    sys.modules[helper] = stub
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        del sys.modules[helper]
    with pytest.MonkeyPatch.context() as patch:
        # diffusers looks the class up on sys.modules["transformers"], which importing transformers'
        # processing_utils replaces (a transformers quirk), so patch that module object, not our import.
        patch.setattr(sys.modules["transformers"], "PixtralProcessor", PixtralProcessor)
        yield PixtralProcessor


@pytest.fixture(scope="module")
def flux2_folders(tmp_path_factory: pytest.TempPathFactory, pixtral: type) -> dict[str, Path]:
    """The tiny encoders (seed 7, fp32) saved by diffusers as a Flux2Pipeline and a Flux2KleinPipeline folder."""
    from tests.text.flux2_setup import FLAVOURS, pipeline_for  # diffusers: imported by the tests that need it

    root = tmp_path_factory.mktemp("flux2")
    folders = {}
    for flavour, cls in FLAVOURS.items():
        folders[flavour] = root / f"FLUX.2-{flavour}-tiny"
        pipeline_for(cls.tiny(seed=7), pixtral).save_pretrained(folders[flavour])
    return folders
