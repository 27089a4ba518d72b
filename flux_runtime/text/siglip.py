"""SigLIP, the image encoder FLUX.1 Redux reads: `transformers`' `SiglipVisionModel` and `SiglipImageProcessor`.

Redux conditions on SigLIP's last hidden state (after its post-layernorm, before the pooling head), one
state per patch. The model and the preprocessing are `transformers`' own classes, opened from their folders
exactly as diffusers' `FluxPriorReduxPipeline` opens them, so the pixels SigLIP sees and the states it
gives are the same bits: the processor resizes, rescales and normalises as its `preprocessor_config.json`
says (for FLUX.1-Redux-dev: 384 x 384 bicubic, then (x / 255 - 0.5) / 0.5), in float32, and the result is
cast to the encoder's dtype. Which backend the `SiglipImageProcessor` name gives (torchvision's where it is
installed, else PIL's) is `transformers`' choice, and the same for diffusers in the same environment. It sits with the text encoders because it plays their part (conditioning the
transformer) and loads through the same checked `transformers` path; `transformers` is imported only here,
when a Redux is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flux_runtime.text.hf_weights import check_model_folder, load_checked
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import SiglipVisionModel

__all__ = ["SiglipImageEncoder"]

# a SigLIP vision model's own folder, or a whole SigLIP (vision + text) whose vision half is read
MODEL_TYPES = ("siglip_vision_model", "siglip")


class SiglipImageEncoder:
    """SigLIP's vision tower and its image processor: PIL images in, (B, patches, hidden) states out."""

    def __init__(self, model: SiglipVisionModel, processor: Any) -> None:
        self.model, self.processor = model, processor

    @classmethod
    def from_folders(
        cls, model_folder: Path, processor_folder: Path, *, device: torch.device | str, dtype: torch.dtype
    ) -> SiglipImageEncoder:
        """The vision model from `model_folder` in `dtype` on `device`, the processor from `processor_folder`."""
        check_model_folder(model_folder, "SigLIP image encoder")
        found = read_json_object(model_folder / "config.json").get("model_type")
        if found not in MODEL_TYPES:
            raise WeightsError(
                f"{model_folder} holds a {found!r} model; the Redux image encoder is a SigLIP vision model "
                f"(model_type {' or '.join(repr(t) for t in MODEL_TYPES)})"
            )
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        # not shown: the load report of a whole SigLIP's text half, which is not read (missing vision weights
        # are an error of `load_checked`), and the notice of the backend the `SiglipImageProcessor` name
        # resolves to (torchvision's, else PIL's), which diffusers, opening the same name, gets too
        hf_logging.set_verbosity_error()
        try:
            from transformers import SiglipImageProcessor, SiglipVisionModel

            model = load_checked(SiglipVisionModel, model_folder, dtype, device, "SigLIP image encoder")
            processor = SiglipImageProcessor.from_pretrained(processor_folder, local_files_only=True)
        finally:
            hf_logging.set_verbosity(level)
        return cls(model.eval(), processor)

    @property
    def tokens(self) -> int:
        """States per image: one per patch of the processed image."""
        config = self.model.config
        return (config.image_size // config.patch_size) ** 2

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def encode(self, images: list[Any], device: torch.device) -> Tensor:
        """SigLIP's last hidden state of `images` (B, N, hidden) in the encoder's dtype, as
        `FluxPriorReduxPipeline.encode_image` computes it: preprocess (resize, RGB, float32 pixels), cast to
        the encoder's dtype, run the encoder where it sits (`device`, the pipeline's)."""
        dtype = next(self.model.parameters()).dtype
        features = self.processor.preprocess(
            images=images, do_resize=True, return_tensors="pt", do_convert_rgb=True
        )
        features = features.to(device=device, dtype=dtype)
        return self.model(**features).last_hidden_state
