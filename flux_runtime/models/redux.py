"""FLUX.1 Redux's image embedder: SigLIP's patch states projected to the width of FLUX.1's text tokens.

Two linear layers with a SiLU between, `redux_up` (SigLIP width → 3 x text width) and `redux_down`
(→ text width): the same layers, names and order as BFL's `flux1-redux-dev.safetensors` and the
`image_embedder/` of the diffusers folder, so either file loads without renaming a key. What comes out is
one token per SigLIP patch (729 for SigLIP so400m at 384 px), appended to the T5 tokens the transformer reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["ReduxConfig", "ReduxEmbedder"]


@dataclass(frozen=True)
class ReduxConfig:
    """The embedder's widths: SigLIP's hidden size in (`redux_dim`), the text token width out."""

    redux_dim: int = 1152
    txt_in_features: int = 4096

    @property
    def hidden(self) -> int:
        """The width between the two layers: three times the text width, as BFL trained it."""
        return 3 * self.txt_in_features


class ReduxEmbedder(nn.Module):
    """`redux_down(silu(redux_up(x)))` over SigLIP's last hidden state (B, N, redux_dim) → (B, N, txt width)."""

    def __init__(self, config: ReduxConfig) -> None:
        super().__init__()
        self.config = config
        self.redux_up = nn.Linear(config.redux_dim, config.hidden)
        self.redux_down = nn.Linear(config.hidden, config.txt_in_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.redux_down(nn.functional.silu(self.redux_up(x)))
