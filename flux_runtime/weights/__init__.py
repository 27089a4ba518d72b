"""Checkpoint discovery, layout conversion and strict streaming loads.

`load_transformer`, `load_vae`, `load_controlnet` and `WeightsError` are imported on first use, so that a module of
this package (the load's pinned ring, say) can be imported without the model classes behind the loaders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flux_runtime.weights.controlnet import load_controlnet
    from flux_runtime.weights.errors import WeightsError
    from flux_runtime.weights.transformer import load_transformer
    from flux_runtime.weights.vae import load_vae

__all__ = ["WeightsError", "load_controlnet", "load_transformer", "load_vae"]

_HOMES = {
    "WeightsError": "flux_runtime.weights.errors",
    "load_controlnet": "flux_runtime.weights.controlnet",
    "load_transformer": "flux_runtime.weights.transformer",
    "load_vae": "flux_runtime.weights.vae",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flux_runtime.weights' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found directly from now on
    return value
