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

# The encoders load lazily (PEP 562): importing one family's encoder does not import the others' transformers
# classes, which take seconds.
_WHERE = {
    "MAX_SEQUENCE_LENGTH": "flux1",
    "Flux1TextEmbeddings": "flux1",
    "Flux1TextEncoder": "flux1",
    "Flux2TextEmbeddings": "flux2",
    "Flux2TextEncoder": "flux2",
    "KleinTextEncoder": "flux2",
    "Flux3TextEmbeddings": "flux3",
    "Flux3TextEncoder": "flux3",
}


def __getattr__(name: str) -> object:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"flux_runtime.text.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'flux_runtime.text' has no attribute {name!r}")


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
