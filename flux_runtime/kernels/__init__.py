"""Elementwise chains of the FLUX blocks, each a named op with a plain PyTorch reference.

Every op here is called by the models through the name exported below. The reference
implementation *is* the model math (op for op what diffusers runs); fused Triton kernels
live beside their reference in the same module and are picked by `dispatch`: the pipeline sets the
tier with `use_fused("lossless")` and reads `fused_ops_report()` to say which kernels actually ran.
`gguf_dequant_as` is the weight of a GGUF projection (`gguf_dequant` the reference, its kernel in
`gguf_dequant_triton`, a module of its own beside it).

This package imports nothing from the rest of `flux_runtime`.
"""

from flux_runtime.kernels.attention_act_fp8 import attention_act_fp8
from flux_runtime.kernels.attention_backends import attention_backend, set_attention_backend
from flux_runtime.kernels.attention_quant import Fp8Heads
from flux_runtime.kernels.dispatch import (
    FusedOpsReport,
    fused_ops_report,
    fused_tier,
    reset_fused_ops_report,
    use_fused,
)
from flux_runtime.kernels.fp8 import (
    Fp8Act,
    Fp8Quant,
    fp8_linear,
    gelu_tanh_fp8,
    quantize,
    quantize_reference,
    swiglu_fp8,
)
from flux_runtime.kernels.gated_residual import gated_residual
from flux_runtime.kernels.gelu import gelu_tanh
from flux_runtime.kernels.gguf_dequant_triton import dequantize_as as gguf_dequant_as
from flux_runtime.kernels.heads_fp8 import heads_fp8, qk_norm_rope_fp8
from flux_runtime.kernels.layer_norm_modulate import (
    layer_norm_modulate,
    layer_norm_modulate_fp8,
    residual_layer_norm_modulate,
    residual_layer_norm_modulate_fp8,
)
from flux_runtime.kernels.linear import linear, split_linear
from flux_runtime.kernels.modulate import modulate
from flux_runtime.kernels.qk_norm_rope import (
    empty_heads,
    head_major_layout,
    is_head_major,
    qk_norm_rope,
    set_head_major,
)
from flux_runtime.kernels.qk_norm_rope_fp32 import qk_norm_rope_fp32
from flux_runtime.kernels.swiglu import swiglu
from flux_runtime.kernels.token_gated_residual import joint_token_gated_residual, token_gated_residual
from flux_runtime.kernels.token_layer_norm_modulate import (
    token_layer_norm_modulate,
    token_layer_norm_modulate_fp8,
)

__all__ = [
    "Fp8Act",
    "Fp8Heads",
    "Fp8Quant",
    "FusedOpsReport",
    "attention_act_fp8",
    "attention_backend",
    "empty_heads",
    "fp8_linear",
    "fused_ops_report",
    "fused_tier",
    "gated_residual",
    "gelu_tanh",
    "gelu_tanh_fp8",
    "gguf_dequant_as",
    "head_major_layout",
    "heads_fp8",
    "is_head_major",
    "joint_token_gated_residual",
    "layer_norm_modulate",
    "layer_norm_modulate_fp8",
    "linear",
    "modulate",
    "qk_norm_rope",
    "qk_norm_rope_fp8",
    "qk_norm_rope_fp32",
    "quantize",
    "quantize_reference",
    "reset_fused_ops_report",
    "residual_layer_norm_modulate",
    "residual_layer_norm_modulate_fp8",
    "set_attention_backend",
    "set_head_major",
    "split_linear",
    "swiglu",
    "swiglu_fp8",
    "token_gated_residual",
    "token_layer_norm_modulate",
    "token_layer_norm_modulate_fp8",
    "use_fused",
]
