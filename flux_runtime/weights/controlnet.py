"""`load_controlnet`: a FLUX.1 ControlNet from a diffusers folder or file (InstantX, Shakker-Labs, union
ControlNets, XLabs' `-diffusers` repos), an XLabs single file, or a cached Hugging Face id.

The layout is read from the keys, never from names: diffusers' (`controlnet_x_embedder`, `transformer_blocks`)
goes through the FLUX.1 layout table plus the ControlNet's own keys, XLabs' (`pos_embed_input`,
`double_blocks`) is our module names already. The shape (depths, widths, union modes, the pixel hint encoder,
a guidance embedder) comes from the tensors, the RoPE axes from a folder's config.json (else FLUX.1's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from flux_runtime.models.dit.controlnet import HINT_STRIDES, ControlNetConfig, Flux1ControlNet
from flux_runtime.weights import flux1_layout
from flux_runtime.weights.checkpoint import dit_config, rope_axes
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.dit_loading import check_table_keys, checked_load_args, layout_reader, load_checked
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve, safetensors_files
from flux_runtime.weights.keys import need_shape
from flux_runtime.weights.safetensors_io import TensorSource, files_fingerprint

log = logging.getLogger(__name__)

_D = "transformer_blocks"
_S = "single_transformer_blocks"
# a key only a ControlNet has, per layout
_MARKS = {"diffusers": "controlnet_x_embedder.weight", "xlabs": "pos_embed_input.weight"}


def load_controlnet(
    path_or_id: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Flux1ControlNet:
    """Load a FLUX.1 ControlNet, ready for inference (eval mode, no grads).

    `path_or_id`: a diffusers ControlNet folder (`config.json` + `diffusion_pytorch_model*.safetensors`), one
    .safetensors file in diffusers' or XLabs' layout, a folder holding one, or a Hugging Face id in the local
    cache. `.control.kind` says what loaded (`instantx`, `union`, `xlabs`); `.path` where it was read, `.source`
    its files and `.fingerprint` a short hash of them (names, sizes, headers), both recorded in the provenance.
    """
    device, dtype = checked_load_args(device, dtype, False)
    files, folder_config = controlnet_files(path_or_id)
    src = TensorSource(files)
    layout = detect_layout(src.keys(), files[0])
    reader = layout_reader(src, "bfl" if layout == "xlabs" else layout)
    keys = set(reader.keys())
    cfg = infer_config(layout, keys, reader.shape, folder_config, files[0])
    log.info("loading a %s ControlNet (%s layout) from %s", cfg.kind, layout, files[0])
    table = None
    if layout == "diffusers":
        table = rules(cfg)
        check_table_keys(table, keys)
    hidden = cfg.dit.hidden_size
    model = load_checked(
        Flux1ControlNet, cfg, "bfl" if layout == "xlabs" else layout, reader, keys=keys,  # type: ignore[arg-type]
        shape_of=reader.shape, table=table, split=lambda r, t: flux1_layout.bfl_to_diffusers(r, t, hidden),
        assemble=flux1_layout.diffusers_to_bfl, device=device, dtype=dtype, fp8_src=None, fp8=False,
    )  # fmt: skip
    model.path = str(resolve(path_or_id).resolve())
    model.source = [str(f) for f in files]
    model.fingerprint = files_fingerprint(files)
    return model  # type: ignore[return-value]


def controlnet_files(path_or_id: str | Path) -> tuple[list[Path], dict | None]:
    """(the safetensors files, the folder's config.json or None) of a ControlNet given as a file, a diffusers
    folder, a folder holding one .safetensors file, or a cached id."""
    path = resolve(path_or_id)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"{path}: ControlNets are read from .safetensors files")
        config = path.parent / "config.json"
        return [path], _read_config(config) if config.is_file() else None
    if (path / "controlnet").is_dir():  # a pipeline root that holds one
        path = path / "controlnet"
    files = safetensors_files(path, "diffusion_pytorch_model") or sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no ControlNet here (no .safetensors file)")
    if len(files) > 1 and not files[0].name.startswith("diffusion_pytorch_model"):
        names = ", ".join(f.name for f in files)
        raise WeightsError(f"{path}: give the ControlNet file itself; this folder holds {names}")
    config = path / "config.json"
    return files, _read_config(config) if config.is_file() else None


def _read_config(path: Path) -> dict:
    return read_json_object(path)


def detect_layout(keys: list[str], where: Path) -> str:
    """'diffusers' or 'xlabs', from the keys; anything else (a transformer, a LoRA, another model) named."""
    stripped = {flux1_layout.strip_prefix(k) for k in keys}
    for layout, mark in _MARKS.items():
        if mark in stripped:
            return layout
    if any(k.startswith(("final_layer.", "proj_out.")) for k in stripped):
        raise WeightsError(
            f"{where}: a transformer, not a ControlNet: load it with --model / load_transformer; a ControlNet "
            "holds controlnet_blocks and controlnet_x_embedder (or XLabs' pos_embed_input)"
        )
    sample = ", ".join(sorted(keys)[:4]) or "no keys at all"
    raise WeightsError(
        f"{where}: not a FLUX.1 ControlNet (no controlnet_x_embedder or pos_embed_input; keys: {sample}, ...)"
    )


def infer_config(
    layout: str, keys: set[str], shape_of, folder_config: dict | None, where: Path
) -> ControlNetConfig:
    """The ControlNet's shape from its tensors (`shape_of`), the RoPE axes from `folder_config` or FLUX.1's."""
    if layout == "diffusers":
        double, single = _D, _S
        img_in, txt_in, vec_in = "x_embedder", "context_embedder", "time_text_embed.text_embedder.linear_1"
        qnorm = (f"{_D}.0.attn.norm_q.weight", f"{_S}.0.attn.norm_q.weight")
        mlp = (f"{_D}.0.ff.net.0.proj.weight", f"{_S}.0.proj_mlp.weight")
        guidance, modes, hint = (
            "time_text_embed.guidance_embedder.",
            "controlnet_mode_embedder.weight",
            "input_hint_block.",
        )
    else:
        double, single = "double_blocks", "single_blocks"
        img_in, txt_in, vec_in = "img_in", "txt_in", "vector_in.in_layer"
        qnorm = ("double_blocks.0.img_attn.norm.query_norm.scale", "single_blocks.0.norm.query_norm.scale")
        mlp = ("double_blocks.0.img_mlp.0.weight", "single_blocks.0.linear1.weight")
        guidance, modes, hint = "guidance_in.", "controlnet_mode_embedder.weight", "input_hint_block."
    depth, depth_single, has_guidance = flux1_layout.block_depths(keys, double, single, guidance)
    if depth + depth_single == 0:
        raise WeightsError(f"{where}: a ControlNet with no transformer blocks")
    hidden, in_ch = need_shape(shape_of, f"{img_in}.weight", "hidden size", 2)
    head_dim = need_shape(shape_of, qnorm[0] if depth else qnorm[1], "head dim", 1)[0]
    mlp_rows = need_shape(shape_of, mlp[0] if depth else mlp[1], "MLP width", 2)[0]
    mlp_hidden = mlp_rows if depth or layout == "diffusers" else mlp_rows - 3 * hidden
    if hidden % head_dim:
        raise WeightsError(f"{where}: hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes = rope_axes(head_dim, folder_config, "flux1", 10_000)[0]
    dit = dit_config(
        where, hidden, head_dim, mlp_hidden, in_channels=in_ch, out_channels=in_ch,
        vec_in_dim=need_shape(shape_of, f"{vec_in}.weight", "pooled text width", 2)[1],
        context_in_dim=need_shape(shape_of, f"{txt_in}.weight", "text width", 2)[1],
        depth=depth, depth_single_blocks=depth_single, axes_dim=axes, guidance_embed=has_guidance,
    )  # fmt: skip
    num_modes = need_shape(shape_of, modes, "control modes", 2)[0] if modes in keys else None
    return ControlNetConfig(dit, num_modes=num_modes, hint=any(k.startswith(hint) for k in keys))


def rules(cfg: ControlNetConfig) -> list[flux1_layout.Rule]:
    """The diffusers layout of a ControlNet against our (XLabs / BFL) names: the FLUX.1 transformer's table
    without its final layer, then the ControlNet's own tensors."""
    dit = cfg.dit
    table = [
        r for r in flux1_layout.rules(dit.depth, dit.depth_single_blocks, dit.guidance_embed)
        if not r.bfl.startswith("final_layer.")
    ]  # fmt: skip
    own = [("pos_embed_input", "controlnet_x_embedder")]
    own += [(f"controlnet_blocks.{i}", f"controlnet_blocks.{i}") for i in range(dit.depth)]
    own += [
        (f"controlnet_single_blocks.{i}", f"controlnet_single_blocks.{i}")
        for i in range(dit.depth_single_blocks)
    ]
    if cfg.hint:  # diffusers' ControlNetConditioningEmbedding: conv_in, blocks.0..5, conv_out
        n = len(HINT_STRIDES)
        names = ["conv_in", *(f"blocks.{j}" for j in range(n - 2)), "conv_out"]
        own += [(f"input_hint_block.{2 * j}", f"input_hint_block.{name}") for j, name in enumerate(names)]
    for ours, theirs in own:
        table += [flux1_layout.Rule(f"{ours}.{p}", (f"{theirs}.{p}",)) for p in ("weight", "bias")]
    if cfg.num_modes is not None:
        table.append(
            flux1_layout.Rule("controlnet_mode_embedder.weight", ("controlnet_mode_embedder.weight",))
        )
    return table
