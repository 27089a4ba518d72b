"""The captioned scenes the built-in tiny models are trained on, and the scorer that checks their pictures.

A scene is one to three flat shapes of one colour on a plain or gradient background of another; its caption
comes from a small grammar ("two small red circles on a blue background", "a green triangle at the top left on
a white gradient"). Scenes are drawn from a seed (`sample_scenes`, numpy) and rendered on any torch device
(`render`, antialiased signed-distance masks), so training makes its data on the GPU and nothing is downloaded.
Some caption combinations are held out of training (`HELD_OUT_COLOURS`, `HELD_OUT_PLACES`) and
`held_out_prompts` asks for exactly those. `score` reads a picture back: border pixels classified to the
palette must be the asked background colour, the other pixels the asked shape colour, and their centre of mass
must lie where the caption put the shape.

Used by `scripts/train_tiny.py`, `scripts/eval_tiny.py` and the tests of the shipped models; the runtime never
imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (245, 220, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "orange": (250, 140, 10),
    "purple": (140, 40, 170),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
PLURALS = {"cross": "crosses"}
SIZES = {"small": 0.085, "": 0.13, "large": 0.19}  # shape radius, as a fraction of the image side
COUNT_WORDS = {2: "two", 3: "three"}  # one shape takes the article ("a", "an")
# where a single shape goes: phrase, centre (x, y) as fractions of the side (y grows downwards)
PLACES: dict[str, tuple[str, float, float]] = {
    "left": ("on the left", 0.25, 0.5),
    "right": ("on the right", 0.75, 0.5),
    "top": ("at the top", 0.5, 0.25),
    "bottom": ("at the bottom", 0.5, 0.75),
    "centre": ("in the centre", 0.5, 0.5),
    "top left": ("at the top left", 0.25, 0.25),
    "top right": ("at the top right", 0.75, 0.25),
    "bottom left": ("at the bottom left", 0.25, 0.75),
    "bottom right": ("at the bottom right", 0.75, 0.75),
}
GRADIENT = 0.15  # a gradient background fades this far towards white (dark colours) or black (light ones)

# Combinations training never sees: (shape colour, background colour) pairs, each colour once on each side,
# and (shape, place) pairs. `held_out_prompts` asks for them.
HELD_OUT_COLOURS = (
    ("red", "blue"),
    ("green", "white"),
    ("blue", "yellow"),
    ("yellow", "purple"),
    ("white", "black"),
    ("black", "orange"),
    ("orange", "green"),
    ("purple", "red"),
)
# the (shape colour, background colour) pairs training does see
SEEN_COLOURS = [(a, b) for a in COLOURS for b in COLOURS if a != b and (a, b) not in HELD_OUT_COLOURS]
HELD_OUT_PLACES = (
    ("circle", "top left"),
    ("square", "right"),
    ("triangle", "bottom"),
    ("diamond", "centre"),
    ("star", "top right"),
    ("cross", "left"),
)


@dataclass(frozen=True)
class Scene:
    """One picture's content: what the caption says, plus where each shape landed (fractions of the side)."""

    count: int
    size: str
    colour: str
    shape: str
    place: str | None  # a PLACES key for one shape, None when the shapes are scattered
    background: str
    gradient: bool
    centres: tuple[tuple[float, float], ...]
    radius: float

    @property
    def caption(self) -> str:
        return self.describe()

    def describe(self, omit: str | None = None) -> str:
        """The caption; `omit` (one of `OMITTABLE`) leaves that part out: the shape colour word, the background
        phrase, or the place phrase (a scene with no place has none to leave out)."""
        noun = self.shape if self.count == 1 else PLURALS.get(self.shape, self.shape + "s")
        colour = None if omit == "colour" else self.colour
        phrase = " ".join(w for w in (self.size, colour, noun) if w)
        words = [_article(phrase) if self.count == 1 else f"{COUNT_WORDS[self.count]} {phrase}"]
        if self.place is not None and omit != "place":
            words.append(PLACES[self.place][0])
        if omit != "background":
            words.append(f"on {_article(self.background)} {'gradient' if self.gradient else 'background'}")
        return " ".join(words)


OMITTABLE = ("colour", "background", "place")  # the parts `Scene.describe` can leave out


def partial_captions(scenes: list[Scene], fraction: float, seed: int) -> list[str]:
    """The scenes' captions, a random `fraction` of them with one part left out (`OMITTABLE`, drawn uniformly):
    a DiT trained on them learns what each part alone says, e.g. that the colour word alone sets the shape's
    colour, whatever the background; every caption still describes its picture."""
    rng = np.random.default_rng(seed)
    drop = rng.random(len(scenes)) < fraction
    parts = rng.integers(len(OMITTABLE), size=len(scenes))
    return [s.describe(OMITTABLE[k] if d else None) for s, d, k in zip(scenes, drop, parts, strict=True)]


def splice_donors(scenes: list[Scene], seed: int) -> tuple[list[Scene], list[Scene]]:
    """Two training-distribution donors per scene, drawn from `seed`: the same scene on another background
    (a seen pair with the same shape colour) and the same scene with another shape colour (a seen pair on the
    same background). A text sequence made of the first donor's tokens before the background phrase and the
    second's from it on says everything the scene's own caption says, but each colour only in its own
    phrase's states: the other phrase's states were encoded beside another colour."""
    rng = np.random.default_rng(seed)
    seen = set(SEEN_COLOURS)
    heads, tails = [], []
    for s in scenes:
        backgrounds = [b for b in COLOURS if b != s.background and (s.colour, b) in seen]
        colours = [c for c in COLOURS if c != s.colour and (c, s.background) in seen]
        heads.append(replace(s, background=str(rng.choice(backgrounds))))
        tails.append(replace(s, colour=str(rng.choice(colours))))
    return heads, tails


def background_cut(caption: str) -> str:
    """The caption's words before its background phrase (" on a(n) <colour> background/gradient")."""
    return caption[: caption.rindex(" on a")]


def _article(word: str) -> str:
    """English's indefinite article before `word` ("an orange", "a red")."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def is_held_out(scene: Scene) -> bool:
    """Whether the scene combines a held-out colour pair or a held-out shape and place."""
    return (scene.colour, scene.background) in HELD_OUT_COLOURS or (
        scene.shape,
        scene.place,
    ) in HELD_OUT_PLACES


def _scatter(rng: np.random.Generator, count: int, radius: float) -> tuple[tuple[float, float], ...]:
    """`count` centres inside the image whose shapes do not touch (rejection sampling, then a grid fallback)."""
    lo, hi = radius + 0.04, 1 - radius - 0.04
    for _ in range(200):
        pts = rng.uniform(lo, hi, size=(count, 2))
        d = np.linalg.norm(pts[:, None] - pts[None], axis=-1) + np.eye(count) * 9
        if d.min() > 2.3 * radius:
            return tuple((float(x), float(y)) for x, y in pts)
    return tuple((0.25 + 0.5 * (i % 2), 0.3 + 0.4 * (i // 2)) for i in range(count))


def sample_scene(rng: np.random.Generator, *, held_out: bool = False) -> Scene:
    """One random scene: training scenes avoid the held-out combinations; `held_out=True` draws only those."""
    while True:
        count = int(rng.choice([1, 1, 1, 2, 3]))
        size = str(rng.choice(list(SIZES)))
        colour, background = (str(c) for c in rng.choice(COLOURS, size=2, replace=False))
        shape = str(rng.choice(SHAPES))
        place = str(rng.choice(list(PLACES))) if count == 1 and rng.random() < 0.8 else None
        gradient = bool(rng.random() < 0.3)
        radius = SIZES[size] * (1.0 if count == 1 else 0.8) * float(rng.uniform(0.9, 1.1))
        if place is not None:
            _, x, y = PLACES[place]
            jitter = rng.uniform(-0.04, 0.04, size=2)
            centres: tuple[tuple[float, float], ...] = ((x + float(jitter[0]), y + float(jitter[1])),)
        else:
            centres = _scatter(rng, count, radius)
        scene = Scene(count, size, colour, shape, place, background, gradient, centres, radius)
        if is_held_out(scene) == held_out:
            return scene


def sample_scenes(n: int, seed: int, *, held_out: bool = False) -> list[Scene]:
    """`n` scenes drawn from `seed` (the same list on every machine)."""
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, held_out=held_out) for _ in range(n)]


def held_out_prompts(per_pair: int = 3, seed: int = 1234) -> list[Scene]:
    """Single-shape scenes that each hold a held-out combination: `per_pair` per colour pair, then
    `per_pair` per shape and place; every scene has a place, so all three scores apply."""
    rng = np.random.default_rng(seed)
    out = []
    for colour, background in HELD_OUT_COLOURS:
        for _ in range(per_pair):
            shape = str(rng.choice(SHAPES))
            place = str(rng.choice([p for p in PLACES if (shape, p) not in HELD_OUT_PLACES]))
            out.append(_single(rng, colour, background, shape, place))
    for shape, place in HELD_OUT_PLACES:
        for _ in range(per_pair):
            colour, background = SEEN_COLOURS[int(rng.integers(len(SEEN_COLOURS)))]
            out.append(_single(rng, colour, background, shape, place))
    return out


def seen_prompts(n: int = 42, seed: int = 4321) -> list[Scene]:
    """`n` single-shape, placed scenes from the training distribution (no held-out combination): scored like
    `held_out_prompts`, they tell a model that has not learned a word from one that does not generalise it."""
    rng = np.random.default_rng(seed)
    out: list[Scene] = []
    while len(out) < n:
        colour, background = SEEN_COLOURS[int(rng.integers(len(SEEN_COLOURS)))]
        shape = str(rng.choice(SHAPES))
        place = str(rng.choice([p for p in PLACES if (shape, p) not in HELD_OUT_PLACES]))
        out.append(_single(rng, colour, background, shape, place))
    return out


def place_sweeps(seeds: int = 2, seed: int = 99) -> list[list[Scene]]:
    """Groups of scenes that differ only in their place (every place of `PLACES`, one training colour pair and
    shape per group): rendered with one noise per group, a model that reads place words moves the shape."""
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(seeds):
        colour, background = SEEN_COLOURS[int(rng.integers(len(SEEN_COLOURS)))]
        shape = str(rng.choice(SHAPES))
        size = str(rng.choice(["", "large"]))
        groups.append(
            [
                Scene(1, size, colour, shape, place, background, False, (PLACES[place][1:],), SIZES[size])
                for place in PLACES
            ]
        )
    return groups


def _single(rng: np.random.Generator, colour: str, background: str, shape: str, place: str) -> Scene:
    size = str(rng.choice(list(SIZES)))
    _, x, y = PLACES[place]
    return Scene(1, size, colour, shape, place, background, bool(rng.random() < 0.3), ((x, y),), SIZES[size])


# ---- rendering -------------------------------------------------------------------------------------------


def _polygon_sdf(px: Tensor, py: Tensor, normals: Tensor, offsets: Tensor) -> Tensor:
    """Approximate signed distance to a convex polygon given by unit edge normals (K, 2) and offsets (K,)."""
    d = px[..., None] * normals[:, 0] + py[..., None] * normals[:, 1] - offsets
    return d.amax(dim=-1)


def _regular_normals(k: int, start: float, device: torch.device) -> Tensor:
    a = start + torch.arange(k, device=device, dtype=torch.float32) * (2 * math.pi / k)
    return torch.stack([torch.cos(a), torch.sin(a)], dim=-1)


def _shape_sdf(shape: str, px: Tensor, py: Tensor, r: Tensor) -> Tensor:
    """Signed distance (negative inside) of `shape` of radius `r`, centred at the origin; y points down."""
    dev = px.device
    if shape == "circle":
        return torch.sqrt(px * px + py * py) - r
    if shape == "square":
        return torch.maximum(px.abs(), py.abs()) - 0.85 * r
    if shape == "diamond":
        return (px.abs() + py.abs()) / math.sqrt(2) - 0.75 * r
    if shape == "triangle":  # apex up: edge normals at 90° (down), 210°, 330° in image coordinates
        n = _regular_normals(3, math.pi / 2, dev)
        return _polygon_sdf(px, py - 0.15 * r, n, 0.55 * r[..., None])
    if shape == "star":  # two overlapping triangles (a hexagram)
        up = _polygon_sdf(px, py, _regular_normals(3, math.pi / 2, dev), 0.5 * r[..., None])
        down = _polygon_sdf(px, py, _regular_normals(3, -math.pi / 2, dev), 0.5 * r[..., None])
        return torch.minimum(up, down)
    if shape == "cross":
        bar = torch.maximum(px.abs() - 0.95 * r, py.abs() - 0.3 * r)
        post = torch.maximum(px.abs() - 0.3 * r, py.abs() - 0.95 * r)
        return torch.minimum(bar, post)
    raise ValueError(f"unknown shape {shape!r}")


def render(
    scenes: list[Scene],
    size: int,
    device: torch.device | str = "cpu",
    *,
    rgb: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Render scenes to images (B, 3, size, size) in [-1, 1], fp32, antialiased over about one pixel.

    `rgb` (shape colours, background colours), each (B, 3) in [0, 1], paints the scenes in those colours in
    place of their palette names' (`random_rgb`: the autoencoder's decoder learns any colour on any other)."""
    device = torch.device(device)
    b = len(scenes)
    coords = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) / size
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")  # (S, S)
    colour, bg = (
        c.to(device=device, dtype=torch.float32) for c in (palette_rgb(scenes) if rgb is None else rgb)
    )
    # gradient: towards white for dark colours, towards black for light ones, top to bottom
    light = (bg.mean(dim=1, keepdim=True) > 0.5).float()
    target = 1.0 - light
    amount = torch.tensor([GRADIENT if s.gradient else 0.0 for s in scenes], device=device)[:, None]
    ramp = gy[None, None]  # (1, 1, S, S)
    top, bottom = bg, bg + (target - bg) * amount
    image = top[:, :, None, None] + (bottom - top)[:, :, None, None] * ramp  # (B, 3, S, S)
    alpha = torch.zeros(b, size, size, device=device)
    for shape in SHAPES:
        rows = [i for i, s in enumerate(scenes) if s.shape == shape]
        if not rows:
            continue
        for k in range(3):
            sub = [i for i in rows if len(scenes[i].centres) > k]
            if not sub:
                continue
            cx = torch.tensor([scenes[i].centres[k][0] for i in sub], device=device)[:, None, None]
            cy = torch.tensor([scenes[i].centres[k][1] for i in sub], device=device)[:, None, None]
            r = torch.tensor([scenes[i].radius for i in sub], device=device)[:, None, None]
            sdf = _shape_sdf(shape, gx - cx, gy - cy, r.expand(-1, size, size))
            a = (0.5 - sdf * size).clamp(0, 1)
            idx = torch.tensor(sub, device=device)
            alpha[idx] = torch.maximum(alpha[idx], a)
    image = image * (1 - alpha[:, None]) + colour[:, :, None, None] * alpha[:, None]
    return image * 2 - 1


def palette_rgb(scenes: list[Scene]) -> tuple[Tensor, Tensor]:
    """The scenes' shape and background colours (B, 3) in [0, 1], as `render` paints them by default."""
    shape = torch.tensor([PALETTE[s.colour] for s in scenes], dtype=torch.float32) / 255
    background = torch.tensor([PALETTE[s.background] for s in scenes], dtype=torch.float32) / 255
    return shape, background


def random_rgb(n: int, seed: int, min_distance: float = 0.3, extremes: float = 0.0) -> tuple[Tensor, Tensor]:
    """`n` (shape, background) colour pairs uniform in RGB [0, 1]^3, each pair at least `min_distance` apart
    (so the shape shows), drawn from `seed`. Painting training scenes in them teaches an autoencoder to code
    any colour on any other, rather than only the palette pairs its training scenes combine (an autoencoder
    trained on palette scenes alone miscolours the held-out pairs: red on blue comes back orange).

    `extremes` is the chance that a channel is drawn from its outer 15 % instead ([0, 0.15] or [0.85, 1],
    either end alike). Uniform draws seldom land near the cube's corners and faces, where saturated colours,
    white and black live (within 0.15 of white: 0.2 % of draws), so an autoencoder trained on them alone can
    still miscolour a strong colour on white; 0 draws exactly as before."""
    rng = np.random.default_rng(seed)

    def draw(size: tuple[int, int]) -> np.ndarray:
        out = rng.uniform(size=size)
        if extremes > 0:
            edge = rng.uniform(size=size) < extremes
            end = rng.uniform(size=size) < 0.5
            outer = rng.uniform(0.0, 0.15, size=size)
            out = np.where(edge, np.where(end, 1.0 - outer, outer), out)
        return out

    shape, background = draw((n, 3)), draw((n, 3))
    while True:
        close = np.linalg.norm(shape - background, axis=1) < min_distance
        if not close.any():
            break
        background[close] = draw((int(close.sum()), 3))
    return torch.from_numpy(shape).float(), torch.from_numpy(background).float()


@torch.no_grad()
def round_trip(
    encoder: torch.nn.Module, decoder: torch.nn.Module, scenes: list[Scene], size: int, batch: int = 32
) -> list[np.ndarray]:
    """The scenes rendered, encoded to their posterior means and decoded again, as (size, size, 3) uint8
    pictures: scored like generated ones, they say which colours the decoder can paint at all (a DiT's
    pictures come out of the same decoder)."""
    device = next(decoder.parameters()).device
    dtype = next(decoder.parameters()).dtype
    out: list[np.ndarray] = []
    for i in range(0, len(scenes), batch):
        x = render(scenes[i : i + batch], size, device).to(dtype)
        mean = torch.chunk(encoder(x), 2, dim=1)[0]
        y = decoder(mean).float().clamp(-1, 1)
        out.extend(((y + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy())
    return out


def token_masks(scenes: list[Scene], grid: int) -> np.ndarray:
    """(N, grid * grid) float32, row-major like the DiT's packed image tokens: 1 where a token's square can
    hold part of a shape (its centre within the shape's circumradius, radius * sqrt(2) for a square's
    corners, plus the token's half-diagonal), else 0. A training loss can weight these tokens up, so the
    few that carry the shape's place and colour count for more than the background around them."""
    centres = (np.arange(grid, dtype=np.float32) + 0.5) / grid
    gy, gx = np.meshgrid(centres, centres, indexing="ij")
    out = np.zeros((len(scenes), grid, grid), dtype=np.float32)
    for i, scene in enumerate(scenes):
        reach = scene.radius * math.sqrt(2) + math.sqrt(2) / (2 * grid)
        for cx, cy in scene.centres:
            out[i][(gx - cx) ** 2 + (gy - cy) ** 2 <= reach**2] = 1.0
    return out.reshape(len(scenes), grid * grid)


# ---- scoring ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """What one picture got right: background colour, shape colour, shape place (None: no place asked)."""

    background: bool
    colour: bool
    place: bool | None


def classify(pixels: np.ndarray) -> np.ndarray:
    """Palette index of each pixel of (..., 3) uint8 RGB, by nearest palette colour."""
    pal = np.array(list(PALETTE.values()), dtype=np.float32)
    d = ((pixels[..., None, :].astype(np.float32) - pal) ** 2).sum(-1)
    return d.argmin(-1)


def score(image: np.ndarray, scene: Scene) -> Score:
    """Score an (H, W, 3) uint8 picture against the scene its caption asked for.

    Background: the most common palette colour of the outer eighth of the picture is the one asked.
    Shape colour: of the pixels not of the background colour (at least 0.3 % of the picture), the most common
    is the one asked. Place: the centre of mass of the pixels of the asked colour lies within 0.17 of the
    side from where the caption put the shape (the places are 0.25 apart).
    """
    labels = classify(image)
    fg_idx = COLOURS.index(scene.colour)
    background = _border_colour(labels) == COLOURS.index(scene.background)
    colour = _shape_colour(labels, scene.background) == scene.colour
    place = None
    if scene.place is not None:
        found = _centre(labels, fg_idx)
        _, x, y = PLACES[scene.place]
        place = found is not None and abs(found[0] - x) < 0.17 and abs(found[1] - y) < 0.17
    return Score(bool(background), bool(colour), place)


def _border_colour(labels: np.ndarray) -> int:
    """The most common palette index of the outer eighth of an (H, W) label map."""
    m = max(1, labels.shape[0] // 8)
    border = np.concatenate(
        [labels[:m].ravel(), labels[-m:].ravel(), labels[:, :m].ravel(), labels[:, -m:].ravel()]
    )
    return int(np.bincount(border, minlength=len(COLOURS)).argmax())


def background_colour(image: np.ndarray) -> str:
    """What colour an (H, W, 3) uint8 picture painted its background, as `score` reads it."""
    return COLOURS[_border_colour(classify(image))]


def scores(images: list[np.ndarray], scenes: list[Scene]) -> list[Score]:
    """Each picture's `score` against its scene."""
    return [score(image, s) for image, s in zip(images, scenes, strict=True)]


def hit_rates(
    images: list[np.ndarray], scenes: list[Scene], scored: list[Score] | None = None
) -> dict[str, float]:
    """Fractions of pictures with the asked background colour, shape colour and place (`scored`: their
    `scores`, when the caller has them already)."""
    results = scores(images, scenes) if scored is None else scored
    return {
        "background": float(np.mean([r.background for r in results])),
        "colour": float(np.mean([r.colour for r in results])),
        "place": float(np.mean([r.place for r in results if r.place is not None])),
    }


def _shape_colour(labels: np.ndarray, background: str) -> str | None:
    """The most common palette colour of the pixels not of `background`; None below 0.3 % of the picture."""
    fg = labels[labels != COLOURS.index(background)]
    if fg.size < 0.003 * labels.size:
        return None
    return COLOURS[int(np.bincount(fg, minlength=len(COLOURS)).argmax())]


def shape_colour(image: np.ndarray, background: str) -> str | None:
    """What colour an (H, W, 3) uint8 picture painted its shape, as `score` reads it against `background`."""
    return _shape_colour(classify(image), background)


def _centre(labels: np.ndarray, idx: int) -> tuple[float, float] | None:
    """Centre of mass (x, y, fractions of the side) of the pixels labelled `idx`; None below 0.3 % of them."""
    h, w = labels.shape
    ys, xs = np.nonzero(labels == idx)
    if xs.size < 0.003 * h * w:
        return None
    return float((xs.mean() + 0.5) / w), float((ys.mean() + 0.5) / h)


def centre(image: np.ndarray, colour: str) -> tuple[float, float] | None:
    """Where the pixels of palette `colour` sit in an (H, W, 3) uint8 picture (None: too few of them)."""
    return _centre(classify(image), COLOURS.index(colour))


def place_following(centres: list[tuple[float, float] | None], scenes: list[Scene]) -> float:
    """How far a sweep's shapes move with their place words, 0 (not at all) to about 1 (as far as asked): the
    slope of the found centres on the asked ones, x and y pooled, least squares (a missing shape counts as
    found at the centre of the picture)."""
    found = np.array([c if c is not None else (0.5, 0.5) for c in centres]).ravel()
    asked = np.array([PLACES[s.place][1:] for s in scenes if s.place is not None]).ravel()
    a = asked - asked.mean()
    return float((a * (found - found.mean())).sum() / (a * a).sum())
