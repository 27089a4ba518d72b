"""The FLUX text-to-image pipeline: `Pipeline.from_pretrained(...)` and `pipe(prompt, ...)`."""

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.flux1 import MODEL_IDS, Pipeline, PipelineOutput

__all__ = ["MODEL_IDS", "FluxError", "Pipeline", "PipelineOutput"]
