"""The FLUX text-to-image pipeline: `Pipeline.from_pretrained(...)` and `pipe(prompt, ...)`."""

from flux_runtime.pipeline.entry import Pipeline
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.state import PipelineOutput
from flux_runtime.registry import MODEL_IDS

__all__ = ["MODEL_IDS", "FluxError", "Pipeline", "PipelineOutput"]
