"""What a model's first run fetches from the Hugging Face Hub: `fetch_model`, before anything loads.

The repos a load reads, each planned by the part it plays (`weights.download`): the model's own repo (one
transformer layout, one autoencoder, its text encoders and tokenizers, configs); the text encoders it pairs
with where that repo holds none (the ids given, else BFL's pairing: the registry's for a registry model, the one
its transformer's keys call for otherwise); FLUX.3's prompt upsampler; LoRAs; ControlNets. Local paths and built-in models
need nothing. All repos are planned (a metadata request each) before any file moves, so a gated repo, a missing
network or a full disk is one line before the large transfers; the one exception is a repo the registry does
not know whose text encoders live elsewhere: those are known only from its transformer's keys, once it is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flux_runtime.registry import (
    FLUX2_DEV_TEXT_ENCODERS,
    KLEIN_TEXT_ENCODERS,
    MISTRAL_PROCESSOR_ID,
    MODEL_IDS,
    QWEN3_VL_4B_ID,
    spec_for,
)
from flux_runtime.weights import flux2_layout
from flux_runtime.weights.checkpoint import TransformerCheckpoint
from flux_runtime.weights.download import RepoPlan, Role, fetch, plan_repo
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import hub_id

Wanted = list[tuple[str, Role]]


def fetch_model(
    path_or_id: str | Path,
    *,
    vae: str | Path | None = None,
    text_encoder: str | Path | None = None,
    text_encoder_2: str | Path | None = None,
    upsampler: str | Path | bool = True,
    loras: Sequence[str | Path] = (),
    controlnets: Sequence[str | Path] = (),
) -> list[RepoPlan]:
    """Fetch what loading `path_or_id` with these parts reads and the local cache lacks; return the plans.

    Arguments as `Pipeline.from_pretrained`'s; `upsampler`: FLUX.3's prompt upsampler, True the model's own
    (its repo's `prompt_upsampler/`, else the registry's), False none, or a folder or id; `loras`: LoRA files
    or ids; `controlnets`: ControlNet folders, files or ids. A repo the Hub cannot be reached for is read from the cache when it is there (a warning says so).
    """
    spec = spec_for(path_or_id)
    adapters: Wanted = [(str(lora), "lora") for lora in loras]
    adapters += [(str(net), "controlnet") for net in controlnets]
    if spec is not None and spec.builtin:  # in the package: only the adapters may need fetching
        plans = _plan(adapters)
        fetch(plans)
        return plans
    name = MODEL_IDS.get(str(path_or_id), str(path_or_id))
    main = hub_id(name)
    own_text = text_encoder is None and text_encoder_2 is None
    main_plan = None if main is None else plan_repo(main, "pipeline", text=own_text)
    plans = [] if main_plan is None else [main_plan]
    if main_plan is not None:
        holds_text = any(f.startswith("text_encoder/") for f in main_plan.files)
        holds_upsampler = any(f.startswith("prompt_upsampler/") for f in main_plan.files)
    else:  # a local path, or a repo read from the cache
        root = Path(name).expanduser()
        holds_text, holds_upsampler = (root / "text_encoder").is_dir(), (root / "prompt_upsampler").is_dir()

    wanted: Wanted = [(str(vae), "vae")] if vae is not None else []
    wanted += [(str(t), "model") for t in (text_encoder, text_encoder_2) if t is not None]
    if spec is not None and main_plan is not None and own_text and not holds_text:
        wanted += _roles(spec.text_encoders)
    if upsampler is True and spec is not None and spec.upsampler and not holds_upsampler:
        wanted.append((spec.upsampler, "model"))
    elif not isinstance(upsampler, bool):
        wanted.append((str(upsampler), "model"))
    wanted += adapters
    plans += _plan(wanted)
    fetch(plans)

    # a BFL file set the registry does not know, here or local: its text encoders are told by its keys
    if spec is None and own_text and not holds_text and (main is None or main_plan is not None):
        later = _plan(_paired_text_encoders(name, vae))
        fetch(later)
        plans += later
    return plans


def _plan(wanted: Wanted) -> list[RepoPlan]:
    """The plans of the hub ids in `wanted` (local paths need none), each repo once."""
    plans = []
    for repo, role in dict(wanted).items():
        if hub_id(repo) is None:
            continue
        plan = plan_repo(repo, role)
        if plan is not None:
            plans.append(plan)
    return plans


def _roles(ids: Sequence[str]) -> Wanted:
    """Text encoder ids with what each is read for (FLUX.2 [dev] reads only Mistral Small 3.1's processor)."""
    return [(i, "tokenizer" if i == MISTRAL_PROCESSOR_ID else "model") for i in ids]


def _paired_text_encoders(path_or_id: str, vae: str | Path | None) -> Wanted:
    """The text encoders BFL pairs with the transformer now on disk (none if its folder holds its own): FLUX.1
    CLIP-L and T5-XXL, FLUX.2 by its keys ([dev] embeds guidance; [klein] by its text width), FLUX.3 Qwen3-VL-4B."""
    from flux_runtime.pipeline.sources import find_sources, open_family

    src = find_sources(path_or_id, vae=vae)
    if src.text is not None:
        return []
    family, ckpt = open_family(src)
    if family == "flux1":
        return _roles([str(src.clip), str(src.t5)])
    if family == "flux3":
        return [(QWEN3_VL_4B_ID, "model")]
    assert ckpt is not None  # not a built-in model
    return _roles(_flux2_pairing(ckpt))


def _flux2_pairing(ckpt: TransformerCheckpoint) -> tuple[str, ...]:
    """What the FLUX.2 pipeline pairs this transformer with, read from its keys as the loader reads them."""
    keys = {flux2_layout.strip_prefix(k): k for k in ckpt.source.keys()}
    if any(k.startswith(("guidance_in.", "time_guidance_embed.guidance_embedder.")) for k in keys):
        return FLUX2_DEV_TEXT_ENCODERS
    txt_in = keys.get("txt_in.weight") or keys.get("context_embedder.weight")
    width = ckpt.source.shape(txt_in)[1] if txt_in is not None else None
    if width not in KLEIN_TEXT_ENCODERS:
        raise WeightsError(
            f"{ckpt.where}: no known [klein] text encoder is {width} wide: pass text_encoder=<Qwen3 folder or id>"
        )
    return (KLEIN_TEXT_ENCODERS[width],)
