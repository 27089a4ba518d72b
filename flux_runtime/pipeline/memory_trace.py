"""Measure a forward's peak memory without the memory: live tensor bytes counted under a dispatch mode.

Run a full-size model on the `meta` device (no storage is ever allocated) inside `LiveBytes` and every
tensor an op creates is counted from the moment it exists until its storage is freed (a weakref finalizer
on the storage: views and in-place ops share it, so each allocation counts once, for exactly as long as
Python holds it, which is what the CUDA caching allocator sees as allocated). Sizes round up to the
allocator's 512-byte blocks. Tensors that existed before the mode (weights, inputs) are not counted, so
`peak` is the activation peak of the code exactly as it allocates: the number the memory planner's
activation estimates must stay above (tests/pipeline/test_memory_peaks.py).

On meta, `scaled_dot_product_attention` is one op returning only its output, as the fused GPU kernels
(cuDNN, flash, memory-efficient) allocate it; the fused Triton kernels of the `lossless` tier allocate
their outputs and no more than their references, so the reference path measured here bounds them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


def _rounded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensors created on `device_type` while the mode is on; `peak` the most.

    `exclude`: tensors that exist before (weights, inputs), never counted even when an op returns a
    view of them. `peak_op` names the op that reached the peak (a hint for where to look).
    """

    def __init__(
        self, exclude: Iterable[Tensor] = (), device_type: str = "meta", record: bool = False
    ) -> None:
        super().__init__()
        # with `record`: every allocation `(+1, key, bytes)` and free `(-1, key, bytes)` in order
        self.events: list[tuple[int, int, int]] | None = [] if record else None
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._held = [t.untyped_storage() for t in exclude]  # kept alive, so their ids stay theirs
        self._excluded = {id(s) for s in self._held}
        self._paused = False

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Tensors made inside are excluded too (a model built on meta that stands for no GPU memory)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _freed(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self.live -= size
        if self.events is not None and size:
            self.events.append((-1, key, size))

    def _see(self, t: Tensor, op: str) -> None:
        if t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._excluded:
            return
        if self._paused and key not in self._sizes:
            self._held.append(storage)
            self._excluded.add(key)
            return
        size = _rounded(storage.nbytes())
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            weakref.finalize(storage, self._freed, key)
            self.live += size
            if self.events is not None:
                self.events.append((1, key, size))
        elif size > old:  # resized in place
            self._sizes[key] = size
            self.live += size - old
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._see(t, str(func))
        return out

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is live now."""
        self.peak, self.peak_op = self.live, ""


def peak_of(fn: Any, exclude: Iterable[Tensor], record: bool = False) -> LiveBytes:
    """Run `fn()` under inference mode and `LiveBytes(exclude)`; the tracker, its `peak` filled in."""
    with torch.inference_mode(), LiveBytes(exclude, record=record) as tracker:
        out = fn()
        del out
    return tracker


# ----------------------------------------------------------------------------- the full-size models on meta

META = torch.device("meta")


def meta_fp8(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Swap the block projections that `fp8=True` quantizes for `Fp8Linear`s (dynamic activations), on meta."""
    from flux_runtime.models.dit.layers import Fp8Linear, Linear
    from flux_runtime.weights.fp8 import may_run_fp8

    for name in [n for n, m in model.named_modules() if isinstance(m, Linear) and may_run_fp8(n)]:
        old = model.get_submodule(name)
        with META:
            new = Fp8Linear(
                old.in_features, old.out_features, old.bias is not None, per_channel=True, dtype=dtype
            )
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, new)
    return model


def dit_model(config: Any, *, fp8: bool = False, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A transformer of `config` (a `DiTConfig`) on meta, in `dtype` or with FP8 block projections."""
    from flux_runtime.models.dit.flux1 import Flux1Transformer
    from flux_runtime.models.dit.flux2 import Flux2Transformer
    from flux_runtime.models.dit.flux3 import Flux3Transformer

    cls = {"flux1": Flux1Transformer, "flux2": Flux2Transformer, "flux3": Flux3Transformer}[config.family]
    with META:
        model = cls(config)
        model = model.cast_to(dtype).eval() if config.family == "flux3" else model.to(dtype).eval()
    return meta_fp8(model, dtype) if fp8 else model


def dit_peak(
    model: torch.nn.Module, batch: int, side: int = 1024, txt_tokens: int = 512, record: bool = False
) -> LiveBytes:
    """One forward of `model` (from `dit_model`) on a `side`² image, as the pipeline's `velocity` calls it
    (RoPE tables built beforehand, as the pipeline caches them)."""
    cfg = model.config
    if cfg.family == "flux3":
        return _flux3_peak(model, batch, side, txt_tokens, record)
    dtype = model.img_in.weight.dtype
    n_img = (side // 16) ** 2
    axes = len(cfg.axes_dim)
    with META:
        img = torch.empty(batch, n_img, cfg.in_channels, dtype=dtype)
        txt = torch.empty(batch, txt_tokens, cfg.context_in_dim, dtype=dtype)
        t, g = torch.empty(batch), torch.empty(batch)
        img_ids, txt_ids = torch.empty(n_img, axes), torch.empty(txt_tokens, axes)
        pe = (
            torch.empty(n_img + txt_tokens, sum(cfg.axes_dim)),
            torch.empty(n_img + txt_tokens, sum(cfg.axes_dim)),
        )
        y = torch.empty(batch, cfg.vec_in_dim, dtype=dtype) if cfg.family == "flux1" else None
    inputs = [img, txt, t, g, img_ids, txt_ids, *pe] + ([y] if y is not None else [])
    guidance = g if cfg.guidance_embed else None
    if cfg.family == "flux1":
        run = lambda: model(img, img_ids, txt, txt_ids, t, y, guidance, pe=pe)  # noqa: E731
    else:
        run = lambda: model(img, img_ids, txt, txt_ids, t, guidance, pe=pe)  # noqa: E731
    return peak_of(run, [*model.parameters(), *model.buffers(), *inputs], record)


def _flux3_peak(
    model: torch.nn.Module, batch: int, side: int, txt_tokens: int, record: bool, ref_side: int | None = None
) -> LiveBytes:
    """`dit_peak` for FLUX.3: one forward with its text (and a `ref_side`² reference's) stream, the RoPE
    tables built beforehand, as the pipeline's `velocity` calls it."""
    cfg = model.config
    dtype = model.txt_in.weight.dtype
    n_img, n_ref = (side // 16) ** 2, 0 if ref_side is None else (ref_side // 16) ** 2
    with META:
        img = torch.empty(batch, n_img, cfg.in_channels, dtype=dtype)
        txt = torch.empty(batch, txt_tokens, cfg.context_in_dim, dtype=dtype)
        ref = torch.empty(batch, n_ref, cfg.cond_in_channels, dtype=dtype) if n_ref else None
        t = torch.empty(batch, dtype=dtype)
        target = torch.empty(batch, dtype=dtype) if cfg.flow_map else None
        ids = [torch.empty(n, 4) for n in (txt_tokens, n_img, n_ref)]
        pe = model.rope(ids[0], ids[1], ids[2] if n_ref else None)
    tables = [x for table in pe if table is not None for x in table]
    inputs = [img, txt, t, *ids, *tables] + [x for x in (ref, target) if x is not None]

    def run() -> Any:
        return model(
            img, ids[1], txt, ids[0], t, ref=ref, ref_ids=ids[2] if n_ref else None, target_timesteps=target,
            pe=pe,
        )  # fmt: skip

    return peak_of(run, [*model.parameters(), *model.buffers(), *inputs], record)


def flux3_peak(
    model: torch.nn.Module, batch: int, side: int = 1024, txt_tokens: int = 512, ref_side: int | None = None
) -> LiveBytes:
    """One FLUX.3 forward's activation peak, with an optional `ref_side`² reference image."""
    return _flux3_peak(model, batch, side, txt_tokens, False, ref_side)


def decode_peak(
    vae: torch.nn.Module, batch: int, side: int = 1024, tile: int | None = None, record: bool = False
) -> LiveBytes:
    """One decode of `batch` latents of a `side`² image by `vae` (a FLUX autoencoder on meta)."""
    cfg = vae.config
    f = cfg.spatial_factor
    with META:
        z = torch.empty(batch, cfg.z_channels, side // f, side // f, dtype=next(vae.parameters()).dtype)
    return peak_of(lambda: vae.decode(z, tile=tile), [*vae.parameters(), *vae.buffers(), z], record)


def encoder_peak(
    model: torch.nn.Module, batch: int, tokens: int, record: bool = False, **kwargs: Any
) -> LiveBytes:
    """One forward of a transformers text model on `batch` x `tokens` ids (and an all-ones mask when
    `attention_mask=True`), `kwargs` as our encoders pass them.

    transformers skips the causal mask when the padding mask is all ones, a data-dependent test that meta
    tensors cannot answer: here the mask is always built (what a padded prompt does, the larger case).
    """
    import transformers.masking_utils as masking

    with META:
        ids = torch.zeros(batch, tokens, dtype=torch.long)
        mask = torch.ones(batch, tokens, dtype=torch.long)
    if kwargs.pop("attention_mask", False):
        kwargs["attention_mask"] = mask
    saved = masking._ignore_causal_mask_sdpa
    masking._ignore_causal_mask_sdpa = lambda *a, **k: False
    try:
        return peak_of(
            lambda: model(input_ids=ids, **kwargs), [*model.parameters(), *model.buffers(), ids, mask], record
        )
    finally:
        masking._ignore_causal_mask_sdpa = saved


def t5_xxl_config() -> Any:
    """FLUX.1's T5 v1.1 XXL encoder (4.8 B parameters)."""
    from transformers import T5Config

    return T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                    feed_forward_proj="gated-gelu", is_encoder_decoder=False)  # fmt: skip


def qwen3_vl_4b_config() -> Any:
    """FLUX.3's Qwen3-VL-4B-Instruct: the Qwen3-4B text model (36 layers of 2560) and a 24-layer vision tower of
    1024 (about 4.4 B parameters)."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)  # fmt: skip
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)


def clip_l_config() -> Any:
    """FLUX.1's CLIP ViT-L/14 text encoder (123 M parameters)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                          num_attention_heads=12, max_position_embeddings=77, projection_dim=768)  # fmt: skip


def mistral_small_config(**token_ids: int) -> Any:
    """FLUX.2-dev's Mistral Small 3.1 (24 B: 40 layers of 5120, Pixtral vision tower); `token_ids`: the
    tokenizer's `bos_token_id`, `eos_token_id`, `pad_token_id` and `image_token_index` where known."""
    from transformers import Mistral3Config

    image = token_ids.pop("image_token_index", 10)
    text = dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                hidden_act="silu", rms_norm_eps=1e-5, rope_theta=1e9, max_position_embeddings=131072,
                sliding_window=None, tie_word_embeddings=False, **token_ids)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14)  # fmt: skip
    return Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=image, spatial_merge_size=2,
        projector_hidden_act="gelu", multimodal_projector_bias=False, vision_feature_layer=-1,
    )  # fmt: skip
