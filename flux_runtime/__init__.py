"""flux-runtime: a from-scratch inference runtime for the FLUX image models, bit-identical to diffusers.

`load_transformer`, `load_vae`, `load_controlnet` and `Pipeline` are the entry points. Each is imported on first use, so that
importing the package (as the command-line tools do before they can report errors) loads neither torch
nor `transformers`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flux_runtime.pipeline import FluxError, Pipeline, PipelineOutput
    from flux_runtime.weights import WeightsError, load_controlnet, load_transformer, load_vae

__version__ = "0.1.0"

__all__ = [
    "FluxError",
    "Pipeline",
    "PipelineOutput",
    "WeightsError",
    "__version__",
    "load_controlnet",
    "load_transformer",
    "load_vae",
]


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "PipelineOutput", "FluxError"):
        from flux_runtime import pipeline

        return getattr(pipeline, name)
    if name in ("WeightsError", "load_controlnet", "load_transformer", "load_vae"):
        from flux_runtime import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'flux_runtime' has no attribute {name!r}")
