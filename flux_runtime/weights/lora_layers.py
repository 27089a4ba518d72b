"""Which layers of a loaded FLUX transformer a LoRA can name, in our (BFL) names and in diffusers'.

Our projections carry BFL's names; diffusers splits some of them: a double block's `qkv` is its
`to_q`, `to_k`, `to_v` (text stream: `add_q_proj`, ...), FLUX.1's single-block `linear1` is `to_q`,
`to_k`, `to_v`, `proj_mlp`, and the final adaLN stores its halves swapped (`(scale, shift)` in
diffusers, `(shift, scale)` here). FLUX.3 keeps every projection apart in both namings (one diffusers layer
per layer of ours; only the final adaLN is swapped). A LoRA on a diffusers layer is fused into its rows of
our layer.
The table is read from the model itself (its depths and widths), so a model of any size has its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout

FAMILY_NAMES = {"flux1": "FLUX.1", "flux2": "FLUX.2", "flux3": "FLUX.3"}


@dataclass(frozen=True)
class Layer:
    """One of our projections: its name, the diffusers layers it is made of (their rows in order)."""

    name: str  # BFL module name, e.g. double_blocks.0.img_attn.qkv
    parts: tuple[str, ...]  # diffusers module names, e.g. transformer_blocks.0.attn.to_q, ...
    sizes: tuple[int, ...]  # rows of each part
    swap: bool  # diffusers stores the two row halves swapped (the final adaLN)
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(self.sizes)

    def offset(self, part: int) -> int:
        return sum(self.sizes[:part])


@dataclass(frozen=True)
class Part:
    """A diffusers layer inside one of ours: `layer.parts[index]`."""

    layer: Layer
    index: int

    @property
    def rows(self) -> int:
        return self.layer.sizes[self.index]


class LayerTable:
    """Every projection of one model a LoRA may change, by our name and by diffusers' name.

    `norms` maps diffusers' QK-norm weights (`transformer_blocks.0.attn.norm_q.weight`) to ours
    (`double_blocks.0.img_attn.norm.query_norm.scale`): FLUX.1 control LoRAs replace them outright. FLUX.3 has
    none (its LoRAs are low-rank only: diffusers refuses a FLUX.3 file holding any other tensor).
    """

    def __init__(
        self, family: str, layers: list[Layer], norms: dict[str, str], depths: tuple[int, int]
    ) -> None:
        self.family = family
        self.layers = {layer.name: layer for layer in layers}
        self.parts = {p: Part(layer, i) for layer in layers for i, p in enumerate(layer.parts)}
        self.norms = norms
        self.depths = depths
        # kohya-style names: the module path with "_" for "."
        self.underscored = {name.replace(".", "_"): name for name in self.layers}
        self.underscored_parts = {name.replace(".", "_"): name for name in self.parts}

    @classmethod
    def of(cls, model: nn.Module) -> LayerTable:
        """The table of a FLUX.1 / FLUX.2 / FLUX.3 transformer as it is now (a widened `img_in` included)."""
        cfg = model.config  # type: ignore[attr-defined]
        if cfg.family == "flux3":
            rules = flux3_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.flow_map)
        else:
            layout = flux1_layout if cfg.family == "flux1" else flux2_layout
            rules = layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed)
        h = cfg.hidden_size
        layers, norms = [], {}
        for rule in rules:
            if not rule.bfl.endswith(".weight"):  # QK-norm scales
                if cfg.family != "flux3":
                    norms[rule.diffusers[0]] = rule.bfl
                continue
            name = rule.bfl.removesuffix(".weight")
            module = model.get_submodule(name)
            out, n = module.out_features, len(rule.diffusers)
            sizes = (out,) if n == 1 else (out // 3,) * 3 if n == 3 else (h, h, h, out - 3 * h)
            parts = tuple(d.removesuffix(".weight") for d in rule.diffusers)
            layers.append(Layer(name, parts, sizes, rule.swap_halves, module.in_features))
        return cls(cfg.family, layers, norms, (cfg.depth, cfg.depth_single_blocks))

    def describe(self) -> str:
        """`FLUX.1 model (2 double / 2 single blocks)`, for error messages."""
        name = FAMILY_NAMES[self.family]
        if self.family == "flux3":
            return f"{name} model ({self.depths[0]} blocks per mode / {self.depths[1]} single blocks)"
        return f"{name} model ({self.depths[0]} double / {self.depths[1]} single blocks)"
