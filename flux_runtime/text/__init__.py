"""Text encoders: prompts to the embeddings the DiT is conditioned on.

FLUX.1: CLIP-L pooled + T5-XXL sequence. FLUX.2: three stacked hidden states of a chat LLM (Mistral Small 3.x for
[dev], Qwen3 for [klein]). FLUX.3: eight stacked hidden states of Qwen3-VL.
"""

from flux_runtime.registry import (
    CLIP_L_ID,
    MISTRAL_PROCESSOR_ID,
    MISTRAL_SMALL_ID,
    QWEN3_4B_ID,
    QWEN3_8B_ID,
    QWEN3_VL_4B_ID,
    T5_XXL_ID,
)
from flux_runtime.text.flux1 import MAX_SEQUENCE_LENGTH, Flux1TextEmbeddings, Flux1TextEncoder
from flux_runtime.text.flux2 import (
    Flux2TextEmbeddings,
    Flux2TextEncoder,
    KleinTextEncoder,
)
from flux_runtime.text.flux3 import Flux3TextEmbeddings, Flux3TextEncoder

__all__ = [
    "CLIP_L_ID",
    "MAX_SEQUENCE_LENGTH",
    "MISTRAL_PROCESSOR_ID",
    "MISTRAL_SMALL_ID",
    "QWEN3_4B_ID",
    "QWEN3_8B_ID",
    "QWEN3_VL_4B_ID",
    "T5_XXL_ID",
    "Flux1TextEmbeddings",
    "Flux1TextEncoder",
    "Flux2TextEmbeddings",
    "Flux2TextEncoder",
    "Flux3TextEmbeddings",
    "Flux3TextEncoder",
    "KleinTextEncoder",
]
