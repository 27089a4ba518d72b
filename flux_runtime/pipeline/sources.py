"""Where a pipeline's parts come from: a preset name, a diffusers folder or cached id, or a BFL file set.

The same for every family: the family is told by the registry (built-in models) or the transformer's keys
(`open_family`), not by the name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from flux_runtime.registry import CLIP_L_ID, MODEL_IDS, MODELS, T5_XXL_ID
from flux_runtime.sampling import FLUX1_DEV_SCHEDULE, FLUX1_SCHNELL_SCHEDULE, FLUX2_SCHEDULE, ScheduleConfig
from flux_runtime.weights.checkpoint import TransformerCheckpoint, find_transformer_files, open_transformer
from flux_runtime.weights.config_files import (
    BOOL,
    INT,
    NUMBER,
    STR,
    Kind,
    check_fields,
    read_json_if_present,
)
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.gguf_file import is_gguf_file
from flux_runtime.weights.hub import cached_revision, resolve
from flux_runtime.weights.safetensors_io import read_header

log = logging.getLogger(__name__)

# Built-in random models (no files), from the registry: FLUX.1-shaped `tiny`, FLUX.2 [klein]-shaped `tiny-flux2`.
BUILTIN_MODELS = tuple(s.name for s in MODELS.values() if s.builtin)
# The kinds of the scheduler_config.json and model_index.json fields the pipelines read.
_SCHEDULER_FIELDS: dict[str, Kind] = {
    "num_train_timesteps": INT,
    "shift": NUMBER,
    "use_dynamic_shifting": BOOL,
    "base_image_seq_len": INT,
    "max_image_seq_len": INT,
    "base_shift": NUMBER.or_null(),
    "max_shift": NUMBER.or_null(),
    "shift_terminal": NUMBER.or_null(),
    "time_shift_type": STR,
    **{
        k: BOOL.or_null()
        for k in (
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "invert_sigmas",
            "stochastic_sampling",
            "use_flow_sigmas",
        )
    },
}
_MODEL_INDEX_FIELDS: dict[str, Kind] = {"is_distilled": BOOL}


@dataclass(frozen=True)
class Sources:
    """Resolved locations of the four parts (None: built in / random)."""

    name: str
    transformer: str | Path
    vae: str | Path
    text: Path | None  # a diffusers root holding text_encoder/, tokenizer/, ...
    clip: str | Path | None  # separate CLIP-L folder or id (BFL file sets)
    t5: str | Path | None
    scheduler_config: dict | None
    model_index: dict | None = None  # a diffusers root's model_index.json (FLUX.2 [klein]: `is_distilled`)
    hub_revision: tuple[str, str] | None = None  # (repo, commit) of a transformer read from the Hub's cache


def open_family(src: Sources) -> tuple[str, TransformerCheckpoint | None]:
    """The family of `src`'s transformer ("flux1", "flux2", "flux3") and its opened checkpoint (None for a
    built-in model): from the registry or the checkpoint's headers, no tensor read."""
    spec = MODELS.get(src.name)
    if spec is not None and spec.builtin:
        return spec.family, None
    ckpt = open_transformer(src.transformer)
    return ckpt.family, ckpt


def model_family(
    path_or_id: str | Path,
    *,
    vae: str | Path | None = None,
    text_encoder: str | Path | None = None,
    text_encoder_2: str | Path | None = None,
) -> str:
    """The family of a model name, folder or file, read before anything loads: what a caller checks its
    options against (a FLUX.1-only option on a FLUX.2 model fails at once, not after the load)."""
    src = find_sources(path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
    return open_family(src)[0]


def find_sources(
    path_or_id: str | Path,
    *,
    vae: str | Path | None = None,
    text_encoder: str | Path | None = None,
    text_encoder_2: str | Path | None = None,
) -> Sources:
    """Work out where each part lives. A BFL transformer file takes `ae.safetensors` beside it by default.

    The transformer is looked for first, so a path that holds none says so rather than that its VAE is missing.
    """
    name = MODEL_IDS.get(str(path_or_id), str(path_or_id))
    if name in BUILTIN_MODELS and not Path(name).exists():
        if text_encoder is not None or text_encoder_2 is not None:
            raise WeightsError(
                f"{name} is a built-in model with its own text encoders: text_encoder / text_encoder_2 "
                "(--text-encoder, --text-encoder-2) are for a BFL transformer file; drop them"
            )
        return Sources(name, name, vae or name, None, None, None, None)
    root = resolve(name)
    if root.is_file():
        if not is_gguf_file(root):  # a file that is neither safetensors nor GGUF fails here, naming itself
            read_header(root)
        ae = vae or root.parent / "ae.safetensors"
        if not Path(ae).exists() and vae is None:
            raise WeightsError(
                f"{root} is a transformer file; no ae.safetensors beside it: pass vae=<path> (--vae)"
            )
        return Sources(
            name,
            root,
            ae,
            None,
            text_encoder or CLIP_L_ID,
            text_encoder_2 or T5_XXL_ID,
            None,
            hub_revision=cached_revision(root),
        )
    find_transformer_files(root)
    if (root / "text_encoder").is_dir() and text_encoder is None and text_encoder_2 is None:
        text, clip, t5 = root, None, None
    else:
        text, clip, t5 = None, text_encoder or CLIP_L_ID, text_encoder_2 or T5_XXL_ID
    if vae is None:
        vae = root / "vae" if (root / "vae").is_dir() else root / "ae.safetensors"
        if not Path(vae).exists():
            raise WeightsError(f"{root} has neither vae/ nor ae.safetensors: pass vae=<path> (--vae)")
    scheduler = _read_checked(root / "scheduler" / "scheduler_config.json", _SCHEDULER_FIELDS)
    return Sources(
        name,
        root,
        vae,
        text,
        clip,
        t5,
        scheduler,
        _read_checked(root / "model_index.json", _MODEL_INDEX_FIELDS),
        cached_revision(root),
    )


def _read_checked(path: Path, fields: dict[str, Kind]) -> dict | None:
    """The JSON object in `path` with `fields` type-checked, or None when there is no such file."""
    data = read_json_if_present(path)
    if data is not None:
        check_fields(data, fields, path)
    return data


def schedule_config(scheduler: dict | None, guidance_embed: bool) -> ScheduleConfig:
    """The folder's FlowMatchEulerDiscreteScheduler settings, or the dev / schnell preset."""
    if scheduler is None:
        return FLUX1_DEV_SCHEDULE if guidance_embed else FLUX1_SCHNELL_SCHEDULE
    unsupported = [
        k
        for k in (
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "invert_sigmas",
            "stochastic_sampling",
        )
        if scheduler.get(k)
    ]
    if scheduler.get("shift_terminal") or scheduler.get("time_shift_type", "exponential") != "exponential":
        unsupported.append("shift_terminal/time_shift_type")
    if unsupported:
        raise WeightsError(
            f"scheduler_config.json asks for {', '.join(unsupported)}, which FLUX sampling does not use"
        )
    return ScheduleConfig(
        num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)),
        shift=float(scheduler.get("shift", 1.0)),
        mu_rule="linear" if scheduler.get("use_dynamic_shifting") else None,
        base_image_seq_len=int(scheduler.get("base_image_seq_len", 256)),
        max_image_seq_len=int(scheduler.get("max_image_seq_len", 4096)),
        base_shift=float(scheduler.get("base_shift", 0.5)),
        max_shift=float(scheduler.get("max_shift", 1.15)),
    )


def flux2_schedule_config(scheduler: dict | None) -> ScheduleConfig:
    """FLUX.2: the folder's FlowMatchEulerDiscreteScheduler settings with the pipelines' mu rule, or the preset.

    Flux2Pipeline / Flux2KleinPipeline always pass `mu = compute_empirical_mu(tokens, steps)`; the scheduler
    uses it only when `use_dynamic_shifting` is on (the converted FLUX.2 folders), otherwise its static `shift`.
    `use_flow_sigmas` makes the pipelines drop their sigmas altogether, a path FLUX.2 checkpoints do not take.
    """
    if scheduler is None:
        return FLUX2_SCHEDULE
    if scheduler.get("use_flow_sigmas"):
        raise WeightsError(
            "scheduler_config.json asks for use_flow_sigmas, which FLUX.2 sampling does not use"
        )
    cfg = schedule_config(scheduler, guidance_embed=True)
    return replace(cfg, mu_rule="empirical") if cfg.mu_rule is not None else cfg
