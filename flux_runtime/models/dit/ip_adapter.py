"""The XLabs FLUX.1 IP-Adapter's modules: the image projection and each double block's image-prompt attention.

An IP-Adapter conditions FLUX.1 on an image: CLIP's projected image embedding becomes a few tokens
(`ImageProjection`, run once per call), and in every double block the image stream's query attends to those
tokens through the block's own key and value projections (`BlockIPAdapter`); the result, scaled, is added to
the image stream after the block's MLP residual. The single blocks are untouched. The ops and their order are
diffusers 0.42.1's `FluxIPAdapterAttnProcessor` and `ImageProjection`, so the bits are its bits:

- the query is the image stream's own, RMS-normed with the block's query norm but not rotated (RoPE applies
  to the joint attention only);
- keys and values are `to_k_ip` / `to_v_ip` of the image tokens, neither normed nor rotated;
- the attention (default SDPA) is cast to the query's dtype, scaled by `scale` and added onto zeros, which is
  what the stream then receives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime.models.dit.layers import EPS, sdpa


class ImageProjection(nn.Module):
    """CLIP's image embedding (N, E) → `tokens` image tokens (N, tokens, width), layer-normed (`proj`, `norm`).

    XLabs' `ip_adapter_proj_model`: one linear to `tokens * width` features, reshaped to tokens, LayerNorm
    (eps 1e-5, affine) over each token. The embedding is cast to the weights' dtype first.
    """

    def __init__(self, embed_dim: int, width: int, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.proj = nn.Linear(embed_dim, tokens * width)
        self.norm = nn.LayerNorm(width)

    def forward(self, embeds: Tensor) -> Tensor:
        x = self.proj(embeds.to(self.proj.weight.dtype))
        return self.norm(x.reshape(embeds.shape[0], self.tokens, -1))


class BlockIPAdapter(nn.Module):
    """One double block's image-prompt key and value projections (width → hidden) and its scale."""

    def __init__(self, width: int, hidden: int, num_heads: int, scale: float = 1.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_k_ip = nn.Linear(width, hidden)
        self.to_v_ip = nn.Linear(width, hidden)
        self.scale = scale

    def forward(self, img_q: Tensor, query_norm: Tensor, states: Tensor) -> Tensor:
        """What the image stream gains (B, L_img, hidden): the image query `img_q` (B, L_img, H, Dh) as the
        block projected it (before its norm), the block's query-norm weight, the image tokens `states`
        (B, 1, T, width) of this branch."""
        b, n, h, dh = img_q.shape
        # diffusers norms its `to_q` output, a contiguous tensor; the block's query may be a view of its qkv
        q = F.rms_norm(img_q.contiguous(), (dh,), query_norm, EPS)
        k = self.to_k_ip(states).view(b, -1, h, dh)
        v = self.to_v_ip(states).view(b, -1, h, dh)
        out = sdpa(q, k, v).reshape(b, -1, h * dh).to(q.dtype)
        total = torch.zeros(b, n, h * dh, dtype=q.dtype, device=q.device)
        return total.add_(self.scale * out)


class IPAdapter(nn.Module):
    """The adapter as loaded onto a FLUX.1 transformer: the image projection and one `BlockIPAdapter` per double
    block (`blocks.N`), in the transformer's dtype and on its device."""

    def __init__(
        self, embed_dim: int, width: int, tokens: int, hidden: int, num_heads: int, depth: int
    ) -> None:
        super().__init__()
        self.image_proj = ImageProjection(embed_dim, width, tokens)
        self.blocks = nn.ModuleList(BlockIPAdapter(width, hidden, num_heads) for _ in range(depth))
        self._index: dict[int, int] = {}  # id(double block) → its BlockIPAdapter (`attach`)

    def attach(self, double_blocks: nn.ModuleList) -> None:
        """Pair `blocks[i]` with the transformer's double block i (XLabs numbers them alike)."""
        if len(double_blocks) != len(self.blocks):
            raise ValueError(f"{len(self.blocks)} adapter blocks for {len(double_blocks)} double blocks")
        self._index = {id(block): i for i, block in enumerate(double_blocks)}

    def prompt(self, states: Tensor) -> ImagePrompt:
        """What one forward's double blocks read: this adapter and one branch's image tokens `states`."""
        return ImagePrompt(self, states)

    @property
    def embed_dim(self) -> int:
        """The width of the CLIP image embedding the projection reads."""
        return self.image_proj.proj.in_features

    def set_scale(self, scales: list[float]) -> None:
        """One scale per double block."""
        for block, scale in zip(self.blocks, scales, strict=True):
            block.scale = scale

    def project(self, embeds: Tensor) -> Tensor:
        """CLIP image embeddings (B, 1, E), one image per row, → the image tokens (B, 1, T, width) every block
        reads, as diffusers' `MultiIPAdapterImageProjection` shapes them."""
        b, n = embeds.shape[:2]
        tokens = self.image_proj(embeds.reshape(b * n, *embeds.shape[2:]))
        return tokens.reshape(b, n, *tokens.shape[1:])


class ImagePrompt:
    """One forward's image prompt: the adapter and the image tokens (B, 1, T, width) of the branch being run."""

    def __init__(self, adapter: IPAdapter, states: Tensor) -> None:
        self.adapter, self.states = adapter, states

    def attention(self, block: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
        """`term(img_q, query_norm)`: what double block `block` adds to its image stream (`BlockIPAdapter`)."""
        ip = self.adapter.blocks[self.adapter._index[id(block)]]
        return lambda img_q, query_norm: ip(img_q, query_norm, self.states)
