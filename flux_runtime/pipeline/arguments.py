"""Keyword arguments a pipeline call (or `Pipeline.from_pretrained`) does not take: one FluxError naming each
and what to pass instead.

A call with an argument its family does not take (diffusers' `num_inference_steps`, FLUX.1's `strength` on a
FLUX.2 model, a typo) would otherwise end in Python's bare "unexpected keyword argument" TypeError, which
names neither the right spelling nor the model that does take it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flux_runtime.pipeline.errors import FluxError

# diffusers' names for arguments this runtime spells otherwise, or does not take
_DIFFUSERS: dict[str, str] = {
    "num_inference_steps": "num_steps=",
    "guidance_scale": "guidance= (FLUX.1 true CFG: true_cfg_scale=)",
    "latents": "seed= or generator= (the start noise is drawn as diffusers draws it)",
    "callback_on_step_end": "progress= (called with the stage, steps done and total)",
    "callback_on_step_end_tensor_inputs": "progress=",
    "return_dict": "nothing: the call returns a PipelineOutput (images, latents, info)",
    "joint_attention_kwargs": "nothing: LoRAs load with pipe.load_lora(path, scale)",
    "attention_kwargs": "nothing: LoRAs load with pipe.load_lora(path, scale)",
    "sigmas": "num_steps= (the schedule is the model's)",
    "timesteps": "num_steps= (the schedule is the model's)",
    "caption_upsample_temperature": "upsampled_prompt= (a caption written beforehand) or upsample=False",
}
# arguments one family takes and another does not
_FAMILY: dict[str, str] = {
    "strength": "FLUX.1 img2img / inpainting",
    "mask_image": "FLUX.1 inpainting and Fill",
    "control_image": "FLUX.1 Depth / Canny",
    "auto_resize": "FLUX.1 Kontext",
    "max_area": "FLUX.1 Kontext",
    "negative_prompt": "FLUX.1 true CFG",
    "true_cfg_scale": "FLUX.1 true CFG",
    "pooled_prompt_embeds": "FLUX.1",
    "upsample": "FLUX.3 (its prompt upsampler)",
    "upsampled_prompt": "FLUX.3 (its prompt upsampler)",
    "boxes": "FLUX.3 (its prompt upsampler's layout mode)",
}


# diffusers' `from_pretrained` arguments: what this runtime takes instead, or why none is needed
_HUB = "not needed here: the Hub is reached through huggingface_hub's own settings"
_DIFFUSERS_LOAD: dict[str, str] = {
    "torch_dtype": "here pass dtype=",
    "device_map": "here pass device= (and memory= for a GPU memory budget)",
    "max_memory": "here pass memory= (a budget such as '24GB')",
    "low_cpu_mem_usage": "not needed here: weights stream from the files to the device",
    "offload_folder": "here pass memory= (plans move weights between the GPU and host memory, never to disk)",
    "offload_state_dict": "here pass memory=",
    "quantization_config": "here pass fp8=True (an FP8 checkpoint loads as FP8 by itself)",
    "use_safetensors": "not needed here: weights are read from .safetensors files only",
    "cache_dir": "not needed here: the cache is found as huggingface_hub finds it (HF_HOME, HF_HUB_CACHE)",
    "local_files_only": "here pass download=False (or set HF_HUB_OFFLINE=1)",
    "force_download": "not needed here: the cache keeps only complete files (delete one there to fetch it again)",
    "token": f"{_HUB} (`hf auth login`, or HF_TOKEN)",
    "proxies": f"{_HUB} (HTTPS_PROXY)",
    "revision": "here pass that revision's snapshot folder in the cache as path_or_id",
    "transformer": "here pass the transformer's file or folder as path_or_id (vae=, text_encoder= for the rest)",
    "custom_pipeline": "not needed here: the family is read from the checkpoint's keys",
    "trust_remote_code": "not needed here: no code is loaded from a checkpoint",
}


def reject_unknown_load(load: Callable[..., Any], unknown: Mapping[str, Any]) -> None:
    """Raise one FluxError for the keyword arguments in `unknown` that `load` (`Pipeline.from_pretrained`)
    does not take: diffusers' spellings with ours, typos with the nearest argument. Nothing when none."""

    def hint(name: str) -> str | None:
        return f"{name} is diffusers' argument; {_DIFFUSERS_LOAD[name]}" if name in _DIFFUSERS_LOAD else None

    _raise_unknown("Pipeline.from_pretrained", load, unknown, hint)


def reject_unknown(call: Callable[..., Any], unknown: Mapping[str, Any], model: str, family: str) -> None:
    """Raise one FluxError for the keyword arguments in `unknown` that `call` (a recipe's `__call__`) does
    not take; nothing when there are none. `model` and `family` ("FLUX.1", ...) name what was called."""

    def hint(name: str) -> str | None:
        if name in _DIFFUSERS:
            return f"{name} is diffusers' argument; here pass {_DIFFUSERS[name]}"
        if name in _FAMILY:
            return f"{name} is a {_FAMILY[name]} argument and {model} is {family}"
        return None

    _raise_unknown(model, call, unknown, hint)


def _raise_unknown(
    what: str, fn: Callable[..., Any], unknown: Mapping[str, Any], hint: Callable[[str], str | None]
) -> None:
    """One FluxError: "`what` does not take a, b: " and, per name, `hint`'s word or the nearest of `fn`'s
    parameters (a typo)."""
    if not unknown:
        return
    accepted = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls", "unknown")]
    hints = []
    for name in unknown:
        said = hint(name)
        if said is None:
            close = difflib.get_close_matches(name, accepted, n=1)
            said = f"{name} is not an argument" + (f": did you mean {close[0]}?" if close else "")
        hints.append(said)
    raise FluxError(f"{what} does not take {', '.join(unknown)}: " + "; ".join(hints))
