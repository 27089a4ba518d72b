"""Fetching checkpoints from the Hugging Face Hub on first use: exactly the files the loaders read.

A repo is fetched by a plan: its file list (one metadata request) filtered by the part the repo plays in a
load (`Role`, `plan_files`), so a repo that holds the same weights twice (FLUX.1-dev: the BFL single file
beside the diffusers `transformer/` folder, `ae.safetensors` beside `vae/`) leaves one copy in the cache.
The transfer is huggingface_hub's (`snapshot_download` with `allow_patterns`: its cache, its retries and
resumed ranges, its progress bars, its token). What stops a first run is one WeightsError line, said before
any large transfer where it can be known there: a gated repo, no network, not enough disk.

Nothing here runs when downloads are off (`HF_HUB_OFFLINE=1`, `--offline`, `download=False`): the loaders
then read the local cache only, through `hub.resolve`.
"""

from __future__ import annotations

import errno
import importlib
import logging
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import cached_snapshot

log = logging.getLogger(__name__)

Role = Literal["pipeline", "model", "tokenizer", "vae", "lora", "controlnet"]
"""What a repo is read for: `pipeline` a model's own repo (a diffusers pipeline folder or a BFL file set);
`model` a transformers model with its tokenizer (a text encoder, the prompt upsampler), or the text encoder
folders of a diffusers pipeline; `tokenizer` its tokenizer and processor files only (FLUX.2 [dev] reads Mistral
Small 3.1's processor beside 3.2's weights); `vae` an autoencoder; `lora` one LoRA file."""

# Small files read beside the weights: configs, tokenizers, chat templates, sentencepiece models.
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
# A diffusers pipeline's folders the loaders read besides transformer/ and vae/ ...
PIPELINE_PARTS = ("scheduler", "guider", "prompt_upsampler")
# ... and its text encoders' folders, read unless other text encoders are given.
TEXT_PARTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
# The weight files each loader opens, in its order of preference: (stem, suffix); a stem's
# `.index.json` names its shards `<stem>-00001-of-0000N<suffix>`.
DIFFUSERS_WEIGHTS = (("diffusion_pytorch_model", ".safetensors"),)
TRANSFORMERS_WEIGHTS = (("model", ".safetensors"), ("pytorch_model", ".bin"))
BFL_VAE = "ae.safetensors"
LORA_FILE = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class RepoPlan:
    """The files of one Hub repo that a load reads, at one commit, with their sizes in bytes."""

    repo_id: str
    role: Role
    revision: str  # the commit the listing is of
    files: dict[str, int]  # path in the repo → size
    repo_size: int  # all the repo's files together
    # the planned files not in this commit's snapshot → bytes to transfer (0: the cache holds the same blob)
    missing: dict[str, int]

    @property
    def size(self) -> int:
        return sum(self.files.values())

    @property
    def to_fetch(self) -> int:
        return sum(self.missing.values())

    def describe(self) -> str:
        """One line: the repo, its commit, and how much of it the plan holds."""
        return (
            f"{self.repo_id} ({self.revision[:7]}): {len(self.files)} files, {size_text(self.size)} of the "
            f"repository's {size_text(self.repo_size)}"
        )


def size_text(n: int) -> str:
    """Bytes as the Hub shows them: decimal GB / MB / kB."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------------
# choosing the files


def plan_files(listing: Mapping[str, int] | Iterable[str], role: Role, *, text: bool = True) -> list[str]:
    """The files of a repo with this file list (paths, or paths → sizes) that the loaders read in `role`.

    `pipeline`: where `transformer/` holds diffusers weights, the diffusers folders (the loaders prefer them
    when both layouts are present): `model_index.json`, `transformer/`, `vae/` (else `ae.safetensors`),
    `scheduler/`, `guider/`, `prompt_upsampler/` and, with `text`, the text encoder and tokenizer folders;
    otherwise the BFL file set: the first root `.safetensors` file by name other than `ae.safetensors` (the
    one the transformer loader picks when only these files are there), `ae.safetensors` (or `vae/`) and,
    with `text`, the text folders if the repo has them. In every folder: its configs and one copy of its
    weights (a sharded index with its shards, else the single file), in the loader's format.
    Raises WeightsError when the repo holds nothing the role can load.
    """
    paths = sorted(listing)
    if role == "pipeline":
        return _pipeline_files(paths, text)
    if role == "model":
        if _in_folder(paths, "text_encoder"):  # a diffusers pipeline read for its text encoders
            return _folders(paths, [p for p in TEXT_PARTS if _in_folder(paths, p)])
        weights = _weights(paths, "", TRANSFORMERS_WEIGHTS)
        if not weights:
            raise WeightsError(
                "no model weights (model.safetensors, pytorch_model.bin or their sharded index) at its root"
            )
        return _configs(paths, "") + weights
    if role == "tokenizer":
        return _configs(paths, "")
    if role == "vae":
        if _in_folder(paths, "vae"):
            return _folders(paths, ["vae"])
        weights = _weights(paths, "", DIFFUSERS_WEIGHTS)
        if weights:
            return _configs(paths, "") + weights
        if BFL_VAE in paths:
            return [BFL_VAE]
        raise WeightsError("no autoencoder (vae/, diffusion_pytorch_model.safetensors or ae.safetensors)")
    if role == "controlnet":  # a diffusers ControlNet folder, else its one weight file (XLabs)
        weights = _weights(paths, "", DIFFUSERS_WEIGHTS)
        if weights:
            return _configs(paths, "") + weights
        return _one_root_file(paths, "a ControlNet")
    # lora: the file the LoRA loader picks in a folder
    if LORA_FILE in paths:
        return [LORA_FILE]
    return _one_root_file(paths, "a LoRA")


def _one_root_file(paths: list[str], what: str) -> list[str]:
    """The one .safetensors file at a repo's root; several or none is a WeightsError naming them."""
    root = [p for p in paths if "/" not in p and p.endswith(".safetensors")]
    if len(root) != 1:
        found = ", ".join(root) if root else "none"
        raise WeightsError(
            f"holds {found} at its root; {what} is one .safetensors file: download the one you want yourself"
        )
    return root


def _pipeline_files(paths: list[str], text: bool) -> list[str]:
    files = [p for p in ("model_index.json",) if p in paths]
    parts = [p for p in PIPELINE_PARTS if _in_folder(paths, p)]
    if text:
        parts += [p for p in TEXT_PARTS if _in_folder(paths, p)]
    if _weights(paths, "vae", DIFFUSERS_WEIGHTS):
        parts.append("vae")
    elif BFL_VAE in paths:
        files.append(BFL_VAE)
    if _weights(paths, "transformer", DIFFUSERS_WEIGHTS):
        return files + _folders(paths, ["transformer", *parts])
    # a BFL file set: the transformer loader's pick among the root files, the autoencoder beside it
    dit = [p for p in paths if "/" not in p and p.endswith(".safetensors") and p != BFL_VAE]
    if not dit:
        raise WeightsError(
            "holds no FLUX transformer (no transformer/ folder with diffusers weights, no .safetensors file at "
            "its root)"
        )
    return [dit[0], *files, *_folders(paths, parts)]


def _in_folder(paths: list[str], folder: str) -> bool:
    return any(p.startswith(f"{folder}/") for p in paths)


def _folders(paths: list[str], folders: list[str]) -> list[str]:
    """Each folder's configs and one copy of its weights."""
    out = []
    for folder in folders:
        out += _configs(paths, folder)
        out += _weights(paths, folder, DIFFUSERS_WEIGHTS) or _weights(paths, folder, TRANSFORMERS_WEIGHTS)
    return out


def _configs(paths: list[str], folder: str) -> list[str]:
    """The small files directly in `folder` ("" the root), weight indexes left to `_weights`."""
    prefix = f"{folder}/" if folder else ""
    return [
        p
        for p in paths
        if p.startswith(prefix)
        and "/" not in p[len(prefix) :]
        and p.endswith(CONFIG_SUFFIXES)
        and not p.endswith(".index.json")
    ]


def _weights(paths: list[str], folder: str, kinds: Sequence[tuple[str, str]]) -> list[str]:
    """The first kind of weights `folder` holds: a sharded index and its shards, or the single file."""
    prefix = f"{folder}/" if folder else ""
    for stem, suffix in kinds:
        index = f"{prefix}{stem}{suffix}.index.json"
        if index in paths:
            shard = re.compile(rf"{re.escape(prefix + stem)}-\d+-of-\d+{re.escape(suffix)}")
            return [index, *(p for p in paths if shard.fullmatch(p))]
        if f"{prefix}{stem}{suffix}" in paths:
            return [f"{prefix}{stem}{suffix}"]
    return []


# --------------------------------------------------------------------------------------------------
# asking the Hub


def downloads_allowed(download: bool) -> bool:
    """Whether a load may touch the network: asked for, and huggingface_hub not in offline mode."""
    from huggingface_hub import constants

    return download and not constants.HF_HUB_OFFLINE


def plan_repo(repo_id: str, role: Role, *, text: bool = True) -> RepoPlan | None:
    """The plan of `repo_id`'s default branch in `role` (one metadata request). When the Hub cannot be reached:
    None if the local cache has the repo (the load goes on from there), else one WeightsError line saying so;
    one line too for a repo the Hub does not have or refuses."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import repo_folder_name

    try:
        info = HfApi().model_info(repo_id, files_metadata=True)
    except HfHubHTTPError as e:
        raise _refused(repo_id, e) from None
    except _unreachable() as e:
        if cached_snapshot(repo_id) is None:
            raise WeightsError(
                f"cannot reach the Hugging Face Hub ({constants.ENDPOINT}) to fetch {repo_id}, and it is not in the "
                "local cache: check the network (HTTPS_PROXY for a proxy), or pass the path of local weights "
                "(a diffusers folder or a BFL .safetensors file)"
            ) from None
        log.warning(
            "cannot reach the Hugging Face Hub (%s); %s is read from the local cache", _first(e), repo_id
        )
        return None
    assert info.sha is not None, "the Hub names the commit of every listing"
    listing = {s.rfilename: s.size or 0 for s in info.siblings or []}
    try:
        chosen = plan_files(listing, role, text=text)
    except WeightsError as e:
        raise WeightsError(f"{repo_id} {e}") from None
    files = {p: listing[p] for p in chosen}
    # a file the cache holds under another commit (same blob: its LFS sha256 or git id) is linked, not sent
    blobs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    blob = {s.rfilename: s.lfs.sha256 if s.lfs is not None else s.blob_id for s in info.siblings or []}
    missing = {
        p: 0 if blob.get(p) and (blobs / str(blob[p])).is_file() else size
        for p, size in files.items()
        if not isinstance(try_to_load_from_cache(repo_id, p, revision=info.sha), str)
    }
    return RepoPlan(repo_id, role, info.sha, files, sum(listing.values()), missing)


def fetch(plans: Sequence[RepoPlan]) -> None:
    """Bring the missing files of `plans` into the local cache.

    First the disk (the cache's free space against the bytes to transfer, all repos together), then every
    repo's small files (a gated repo refuses here, before any weights move), then the weights. A dropped
    connection resumes from what was written (huggingface_hub's ranged retries); a run that ends early keeps the
    files it finished, and the next run plans again and fetches only what is still missing.
    """
    todo = [p for p in plans if p.missing]
    if not todo:
        return
    check_disk(sum(p.to_fetch for p in todo), ", ".join(p.repo_id for p in todo))
    for plan in todo:
        log.info("fetching %s of %s", size_text(plan.to_fetch), plan.describe())
    for plan in todo:  # configs and tokenizers first: access is checked before the large transfers
        _download(plan, [f for f in plan.missing if f.endswith(CONFIG_SUFFIXES)])
    for plan in todo:
        _download(plan, list(plan.missing))


def check_disk(need: int, what: str) -> None:
    """One WeightsError naming both sizes unless the cache's disk has `need` bytes free."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE).expanduser()
    free = free_bytes(cache)
    if free < need:
        raise WeightsError(
            f"not enough disk space to fetch {what}: {size_text(need)} needed, {size_text(free)} free in {cache} "
            "(free some space, or point HF_HUB_CACHE or HF_HOME at a larger disk)"
        )


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or would: its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _download(plan: RepoPlan, files: list[str]) -> None:
    """`snapshot_download` of these files of `plan` (at the default branch, whose ref the cache then keeps)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    if not files:
        return
    try:
        snapshot_download(plan.repo_id, allow_patterns=[_literal(f) for f in files])
    except HfHubHTTPError as e:
        raise _refused(plan.repo_id, e) from None
    except _unreachable() as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise WeightsError(
                f"the disk filled up while fetching {plan.repo_id}: free some space, or point HF_HUB_CACHE or "
                "HF_HOME at a larger disk, and run again (the files already fetched are kept)"
            ) from None
        raise WeightsError(
            f"fetching {plan.repo_id} stopped ({_first(e)}): the files already fetched are kept; run again to "
            "fetch the rest"
        ) from None


def _literal(path: str) -> str:
    """`path` as an fnmatch pattern that matches itself only (allow_patterns are patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _refused(repo_id: str, e: BaseException) -> WeightsError:
    """The one line for an HTTP error answer about `repo_id`."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return WeightsError(
            f"{repo_id} is gated: accept its licence on {constants.ENDPOINT}/{repo_id}, then log in here with "
            "`hf auth login` or set HF_TOKEN (a token of the account that accepted it)"
        )
    if isinstance(e, RepositoryNotFoundError):
        return WeightsError(
            f"{repo_id} is not on the Hugging Face Hub, or is private: check the name, or log in with "
            "`hf auth login` or set HF_TOKEN (a token that can read it)"
        )
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", "an error")
    return WeightsError(
        f"the Hugging Face Hub answered {status} for {repo_id} ({_first(e)}): try again later (the files already "
        "fetched are kept)"
    )


def _first(e: BaseException) -> str:
    """The first non-empty line of an error's message, or its type's name."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _unreachable() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when no answer comes: its transport's errors (httpx2 or httpx from
    huggingface_hub 1.0; requests' before, which are OSErrors) and its cache-only fallback's error."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    errors: list[type[BaseException]] = [OSError, LocalEntryNotFoundError]
    for transport in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(transport).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)
