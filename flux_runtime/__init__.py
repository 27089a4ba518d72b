"""flux-runtime: a from-scratch inference runtime for the FLUX image models, bit-identical to diffusers.

`load_transformer`, `load_vae` and `Pipeline` are the entry points; `Pipeline` (which pulls in
`transformers` for the text encoders) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flux_runtime.weights import WeightsError, load_transformer, load_vae

if TYPE_CHECKING:
    from flux_runtime.pipeline import FluxError, Pipeline, PipelineOutput

__version__ = "0.1.0"

__all__ = [
    "FluxError",
    "Pipeline",
    "PipelineOutput",
    "WeightsError",
    "__version__",
    "load_transformer",
    "load_vae",
]


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "PipelineOutput", "FluxError"):
        from flux_runtime import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'flux_runtime' has no attribute {name!r}")
