"""Text encoders: prompts to the embeddings the DiT is conditioned on (FLUX.1: CLIP-L pooled + T5-XXL)."""

from flux_runtime.text.flux1 import (
    CLIP_L_ID,
    MAX_SEQUENCE_LENGTH,
    T5_XXL_ID,
    Flux1TextEmbeddings,
    Flux1TextEncoder,
)

__all__ = ["CLIP_L_ID", "MAX_SEQUENCE_LENGTH", "T5_XXL_ID", "Flux1TextEmbeddings", "Flux1TextEncoder"]
