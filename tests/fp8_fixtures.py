"""Tiny FP8 checkpoints in the real formats, and an FP8 reference built from diffusers' own model.

The reference is written here, independently of the runtime: a copy of diffusers' transformer whose
quantized `nn.Linear`s quantize their input (`x.float() * (1 / s_in)`, clamp ±448, e4m3; per row, with
`s = amax * (1 / 448)`, when
there is no input scale) and run `torch._scaled_mm` with the layer's own scales, one diffusers module at
a time (q, k and v apart).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

E4M3 = torch.float8_e4m3fn

# diffusers modules kept in bf16 (what the ModelOpt recipes keep: embedders, modulation, final layer)
KEEP = re.compile(
    r"(x_embedder|context_embedder|time_text_embed|time_guidance_embed|timestep_embedder|norm|modulation"
    r"|^proj_out)"
)
IGNORE_GLOBS = ["x_embedder", "context_embedder", "time_*", "*norm*", "*modulation*", "proj_out"]


def quantized_modules(model: nn.Module) -> list[str]:
    """The diffusers Linear layers an FP8 export quantizes."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not KEEP.search(n)]


def calibrate(model: nn.Module, run) -> dict[str, float]:
    """max |input| of every quantized Linear over one forward `run(model)` (ModelOpt's max calibration)."""
    amax: dict[str, float] = {}
    hooks = []
    for name in quantized_modules(model):

        def hook(_m, args, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().amax()))

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        run(model)
    for h in hooks:
        h.remove()
    return amax


def fp8_params(
    model: nn.Module, amax: dict[str, float] | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per quantized module: (e4m3 weight, per-tensor weight scale, input scale or None)."""
    out = {}
    for name in quantized_modules(model):
        w = model.get_submodule(name).weight.detach()
        ws = (w.abs().amax().float() / 448.0).reshape(())
        wq = (w.float() / ws).clamp(-448, 448).to(E4M3)
        s_in = None if amax is None else torch.tensor(amax[name] / 448.0, dtype=torch.float32)
        out[name] = (wq, ws, s_in)
    return out


def write_modelopt(model: nn.Module, params: dict, folder: Path, ignore: list[str] = IGNORE_GLOBS) -> Path:
    """A ModelOpt FP8 diffusers folder: e4m3 weights, `[]` and `[1]` scales mixed, the quantization_config."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i, (name, (wq, ws, s_in)) in enumerate(params.items()):
        shape = () if i % 2 else (1,)
        sd[f"{name}.weight"] = wq
        sd[f"{name}.weight_scale"] = ws.reshape(shape)
        if s_in is not None:
            sd[f"{name}.input_scale"] = s_in.reshape(shape)
    save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
    config = dict(model.config)
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "ignore": ignore,
        "producer": {"name": "modelopt", "version": "0.0-test"},
    }
    (folder / "config.json").write_text(json.dumps(config, default=list))
    return folder


class RefFp8Linear(nn.Module):
    """The quantize + scaled-matmul chain of one diffusers Linear (weight scale per tensor or per output row)."""

    def __init__(self, lin: nn.Linear, wq: torch.Tensor, ws: torch.Tensor, s_in: torch.Tensor | None) -> None:
        super().__init__()
        self.wq, self.ws, self.s_in, self.bias = wq, ws, s_in, lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.s_in is None:
            s = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) * (1.0 / 448.0)
            xq = (x2.float() * s.reciprocal()).clamp(-448, 448).to(E4M3)
            ws = (
                self.ws.reshape(1, -1)
                if self.ws.numel() > 1
                else self.ws.reshape(1, 1).expand(1, self.wq.shape[0])
            )
            y = torch._scaled_mm(
                xq, self.wq.t(), scale_a=s, scale_b=ws.contiguous(), bias=self.bias, out_dtype=torch.bfloat16,
            )  # fmt: skip
        else:
            xq = (x2.float() * (1.0 / self.s_in)).clamp(-448, 448).to(E4M3)
            y = torch._scaled_mm(
                xq, self.wq.t(), scale_a=self.s_in, scale_b=self.ws, bias=self.bias, out_dtype=torch.bfloat16
            )
        return y.reshape(*lead, -1)


def fp8_reference(model: nn.Module, params: dict) -> nn.Module:
    """A copy of diffusers' `model` with each quantized Linear replaced by `RefFp8Linear`."""
    ref = copy.deepcopy(model)
    for name, (wq, ws, s_in) in params.items():
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child, RefFp8Linear(ref.get_submodule(name), wq, ws, s_in))
    return ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of two outputs."""
    return float((a.float() - b.float()).norm() / b.float().norm())
