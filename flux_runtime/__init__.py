"""flux-runtime: a from-scratch inference runtime for the FLUX image models, bit-identical to diffusers."""

from flux_runtime.weights import WeightsError, load_transformer, load_vae

__version__ = "0.1.0"

__all__ = ["WeightsError", "__version__", "load_transformer", "load_vae"]
