"""Train the built-in tiny FLUX.1 (`tiny`) or FLUX.2 (`tiny-flux2`) model from a seed on rendered scenes.

What it trains, through the runtime's own model classes (plain PyTorch autograd; the fused kernels are off):

1. The autoencoder (FLUX.1's, or FLUX.2's with its quant convs) on rendered scenes: L1 + L2 reconstruction plus
   a small KL term on the posterior. Then its latent statistics on the data: FLUX.1's scale and shift factors
   (printed, and written to `stats.json`), FLUX.2's BatchNorm running mean and variance (stored in the weights).
2. The DiT with the real objective: rectified flow matching, `x_t = (1 - t) x_0 + t ε`, target `ε - x_0`, with
   `t` logit-normal and then time-shifted exactly as the family's sampler shifts its sigmas at the default
   size and steps (FLUX.1 [dev]: mu from the token count; FLUX.2: the empirical mu), and for FLUX.1 [dev] the
   guidance embedding fed random guidance values in [1, 5]. The tiny text encoders (CLIP + T5, or Qwen3)
   start from the runtime's seeded random weights and train with the DiT, so captions' word order reaches it;
   FLUX.2 [klein] drops 10 % of captions to the empty prompt, the negative prompt its CFG uses.

The latents of a pool of rendered scenes are computed once; the DiT samples batches from that pool. The
output folder holds the weights in the layouts the runtime loads (BFL DiT file, BFL `ae.safetensors`, the text
encoders as transformers folders with their tokenizers), `loss.json` and `loss.png`.

Step counts are fixed by the arguments; `--max-seconds` stops a phase early (the log says where) so a run fits
a device budget, and the learning rate anneals on whichever of steps or time runs out first. `--resume DIR`
starts from the weights in an earlier output folder (the shipped `flux_runtime/assets/models/tiny*` folders
are such folders): autoencoder, DiT and text encoders; with `--vae-steps 0` the autoencoder stays as it is
and its latent statistics (FLUX.1's preset factors, FLUX.2's BatchNorm) stay, so only the DiT and the text
encoders train on. `--decoder-only` (with `--resume`) trains the autoencoder's decoder alone and copies the
rest: the encoder does not move, so neither do the latents the DiT learned; with `--vae-rgb` it learns to paint
colour pairs the scenes never combine. `--encoder-anchor W` (with `--resume`) trains the encoder too, so it can
learn to code such pairs, while a loss term W times its drift on palette scenes keeps the latents of the
training distribution near the ones the DiT learned (the final drift is logged and kept in `loss.json`).

`--caption-drop F` leaves one part out of a fraction F of the pool's captions (the shape colour word, the
background phrase or the place phrase; each caption still true of its picture), so that each part alone says
what it says: a held-out pair's colour word should set the shape's colour whatever background it is asked on.

`--splice F` trains a fraction F of each batch on spliced text: the token states before the background phrase
come from the caption of the same scene on another background, the rest from the caption of the same scene
with another shape colour (`tiny_scenes.splice_donors`; FLUX.1's CLIP pooled state from one of the two at
random). The picture is the scene's own, so the loss rewards reading the shape colour from the colour word's
states and the background from the background phrase's, never from where the text encoder mixed the other in:
how a held-out pair, whose phrases were never encoded side by side, must be read. `--prefix-invariance W` adds
W times the spliced rows' prefix drift to the loss: their own text states before the background phrase against
their head donor's, the same words on another background. FLUX.1's T5 reads both ways, so a held-out caption's
colour word is coded beside a background it never met (the shipped `tiny`'s T5 prefix states move by about their
own size when only the background word changes); the term trains the encoder to code those words the same on
every background. Qwen3 is causal: there the drift is 0.

`--guidance-distill F` (FLUX.1) gives the dev model's guidance embedding its meaning, as guidance distillation
does for FLUX.1 [dev]: rows at guidance 1 train plain flow matching with a tenth of their captions dropped to
the empty prompt, so the model learns its conditional and unconditional velocities; from `--distill-after N`
steps on, a fraction F of each batch is trained at a random guidance g on `v_u + g (v_c - v_u)`, both
velocities from an EMA copy of the model at guidance 1 (`GuidanceTeacher`). Without it the guidance input is
fed random values against a target that does not depend on them, so it learns nothing.

`--freeze-text` keeps the text encoders as they are and embeds the pool's captions once: a step then runs no
encoder. FLUX.2's tiny Qwen3 is 28 layers deep, run forward and backward every step otherwise; in the first
run FLUX.2's DiT (the same width and depth as FLUX.1's) made 1,700 steps in the 285 s FLUX.1's made 4,850 in.

Usage (one H200, both families side by side, about 7 minutes):
    python scripts/train_tiny.py --family flux1 --out out/tiny &
    python scripts/train_tiny.py --family flux2 --out out/tiny-flux2 & wait
Training on from the shipped weights (the DiT only, e.g. for another 7 minutes):
    python scripts/train_tiny.py --family flux2 --out out/tiny-flux2 --vae-steps 0 --freeze-text
        --resume flux_runtime/assets/models/tiny-flux2 --dit-steps 100000 --dit-seconds 420   (one line)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_scenes import (
    Scene,
    background_cut,
    held_out_prompts,
    hit_rates,
    palette_rgb,
    partial_captions,
    random_rgb,
    render,
    round_trip,
    sample_scenes,
    seen_prompts,
    splice_donors,
    token_masks,
)

from flux_runtime.models.dit import Flux1Transformer, Flux2Transformer
from flux_runtime.models.dit.config import TINY_FLUX2_TRAINED, TINY_TRAINED
from flux_runtime.models.vae import Flux1VAE, Flux2VAE
from flux_runtime.models.vae.flux1 import TINY_TRAINED_VAE
from flux_runtime.models.vae.flux2 import TINY_FLUX2_TRAINED_VAE
from flux_runtime.sampling import FLUX1_DEV_SCHEDULE, FLUX2_SCHEDULE
from flux_runtime.sampling.flux2 import flux2_image_ids, flux2_pack, flux2_text_ids, patchify
from flux_runtime.sampling.latents import image_ids, pack
from flux_runtime.text.flux1 import Flux1TextEncoder
from flux_runtime.text.flux2 import NEGATIVE_PROMPT, KleinTextEncoder
from flux_runtime.text.tokenizers import TINY_TOKENIZERS, tiny_tokenizer_path, tokenize

SIZE = 256  # training and default image side
TEXT_LENGTH = 64  # the tiny models' text tokens (every caption of the grammar fits)
DEFAULT_STEPS = 28  # the step count whose time shift FLUX.2's training uses


def _autocast(device: torch.device) -> bool:
    """bf16 autocast on CUDA (FLUX_TINY_AUTOCAST=1 forces it, to try the GPU's number path on a CPU)."""
    return device.type == "cuda" or os.environ.get("FLUX_TINY_AUTOCAST") == "1"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- text encoders with gradients -----------------------------------------------------------------------


class Flux1Text(nn.Module):
    """Tiny CLIP + T5 (the runtime's `Flux1TextEncoder.tiny`), run as `Flux1TextEncoder.encode` runs them."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        enc = Flux1TextEncoder.tiny(seed=seed)
        self.enc = enc
        self.clip, self.t5 = enc.clip, enc.t5

    def tokens(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        clip = tokenize(self.enc.clip_tokenizer, captions, self.enc.clip_max_length, "CLIP")
        t5 = tokenize(self.enc.t5_tokenizer, captions, TEXT_LENGTH, "T5")
        return clip, t5

    def forward(self, clip_ids: Tensor, t5_ids: Tensor) -> tuple[Tensor, Tensor]:
        pooled = self.clip(clip_ids, output_hidden_states=False).pooler_output  # (B, 32)
        txt = self.t5(t5_ids, output_hidden_states=False)[0]  # (B, L, 32)
        return txt, pooled


class KleinText(nn.Module):
    """Tiny Qwen3 (the runtime's `KleinTextEncoder.tiny`): hidden states 9, 18, 27 stacked, as `encode` does."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        enc = KleinTextEncoder.tiny(seed=seed)
        self.enc = enc
        self.model = enc.model

    def tokens(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        return self.enc.tokenize(captions, TEXT_LENGTH)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.model.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        states = torch.stack([out.hidden_states[k] for k in self.enc.layers], dim=1)  # (B, 3, L, 32)
        b, n, length, width = states.shape
        return states.permute(0, 2, 1, 3).reshape(b, length, n * width)  # (B, L, 96)


# ---- initialisation, EMA, schedules -----------------------------------------------------------------------


@torch.no_grad()
def init_dit(model: nn.Module, seed: int) -> None:
    """Linear-style init from `seed`; norm scales 1, biases 0; adaLN projections and the output layer zero,
    so every block starts as the identity (adaLN-Zero) and the first prediction is 0."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 2:
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(p.shape[1]))
        elif name.endswith("scale"):
            p.fill_(1.0)
        else:
            p.zero_()
        if any(k in name for k in ("_mod.", "modulation", "final_layer.linear")):
            p.zero_()


class EMA:
    """Exponential moving average of a module's parameters (what gets shipped)."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - d)

    @torch.no_grad()
    def copy_into(self, source: nn.Module, target: nn.Module) -> None:
        """Write the averages of `source`'s parameters into `target`'s (a copy of `source`: same order)."""
        avg = {id(p): s for p, s in zip(self.params, self.shadow, strict=True)}
        for p, q in zip(source.parameters(), target.parameters(), strict=True):
            q.copy_(avg.get(id(p), p))

    @torch.no_grad()
    def swap(self) -> None:
        for p, s in zip(self.params, self.shadow, strict=True):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


def lr_at(step: int, steps: int, elapsed: float, seconds: float, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5 % over whichever of the step or time budget runs out first."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, max(step / steps, elapsed / seconds))
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def budgeted_steps(
    phase: str, opt: torch.optim.Optimizer, steps: int, seconds: float, lr: float, warmup: int
) -> Iterator[tuple[int, float]]:
    """`(step, seconds elapsed)` for steps 0 .. `steps` - 1 of a training phase, each after setting `opt`'s
    learning rate by `lr_at`; stops early, with a log line, once `seconds` have passed (timed from the first)."""
    start = time.time()
    for step in range(steps):
        elapsed = time.time() - start
        if elapsed > seconds:
            log(f"{phase}: time budget reached after {step} steps")
            return
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, elapsed, seconds, lr, warmup)
        yield step, elapsed


def shifted_t(u: Tensor, mu: float) -> Tensor:
    """The samplers' exponential time shift `e^mu / (e^mu + (1/t - 1))` applied to t in (0, 1)."""
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


# ---- phase 1: the autoencoder ---------------------------------------------------------------------------


def train_vae(
    vae: nn.Module, args: argparse.Namespace, device: torch.device, history: dict, first_step: int = 0
) -> None:
    """Reconstruction + KL on freshly rendered batches; with `args.decoder_only` the encoder is frozen and
    only the decoder learns; with `args.encoder_anchor` both learn, and the encoder's posterior means on the
    batch's palette scenes are pulled towards those of the encoder it started from (log rows count on from
    `first_step`)."""
    params = [p for p in (vae.decoder if args.decoder_only else vae).parameters()]
    opt = torch.optim.AdamW(params, lr=args.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    seed = args.seed * 1000 + 1
    anchor = copy.deepcopy(vae.encoder).eval().requires_grad_(False) if args.encoder_anchor > 0 else None
    k = round(args.vae_batch * args.vae_rgb)  # the batch's first k scenes in random colours
    for step, elapsed in budgeted_steps("vae", opt, args.vae_steps, args.vae_seconds, args.vae_lr, 100):
        scenes = sample_scenes(args.vae_batch, seed + step)
        rgb = None
        if k > 0:  # the first part of the batch in random colours (`random_rgb`), the rest palette
            rnd, pal = random_rgb(k, seed + step, extremes=args.vae_rgb_extremes), palette_rgb(scenes)
            rgb = (torch.cat([rnd[0], pal[0][k:]]), torch.cat([rnd[1], pal[1][k:]]))
        x = render(scenes, SIZE, device, rgb=rgb)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_autocast(device)):
            with torch.set_grad_enabled(not args.decoder_only):
                moments = vae.encoder(x)
            mean, logvar = torch.chunk(moments.float(), 2, dim=1)
            logvar = logvar.clamp(-30.0, 20.0)
            z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
            recon = vae.decoder(z).float()
            drift = torch.zeros((), device=device)
            if anchor is not None and k < args.vae_batch:
                with torch.no_grad():
                    before = torch.chunk(anchor(x[k:]).float(), 2, dim=1)[0]
                drift = (mean[k:] - before).pow(2).mean() / before.var()
        rec = (recon - x).abs().mean() + F.mse_loss(recon, x)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        loss = rec + args.kl_weight * kl + args.encoder_anchor * drift
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            row = {"step": first_step + step, "time": round(elapsed, 1), "rec": rec.item(), "kl": kl.item()}
            history["vae"].append(row | ({"drift": drift.item()} if anchor is not None else {}))
        if step % 200 == 0:
            more = f" drift {drift.item():.5f}" if anchor is not None else ""
            log(f"vae step {step}: rec {rec.item():.4f} kl {kl.item():.3f}{more}")
    if anchor is not None:
        history["encoder_drift"] = encoder_drift(anchor, vae.encoder, device)
        log(
            f"encoder drift on fresh palette scenes (relative mean squared change): {history['encoder_drift']}"
        )


@torch.no_grad()
def encoder_drift(before: nn.Module, after: nn.Module, device: torch.device, n: int = 256) -> float:
    """How far a fine-tuned encoder's posterior means on `n` fresh training scenes moved from the encoder it
    started from: their mean squared difference over the old means' variance (0: the latents the DiT was
    trained on are unchanged)."""
    x = render(sample_scenes(n, 424242), SIZE, device)
    old = torch.cat([torch.chunk(before(x[i : i + 64]).float(), 2, dim=1)[0] for i in range(0, n, 64)])
    new = torch.cat([torch.chunk(after(x[i : i + 64]).float(), 2, dim=1)[0] for i in range(0, n, 64)])
    return round(((new - old).pow(2).mean() / old.var()).item(), 6)


def log_round_trip(vae: nn.Module, history: dict) -> None:
    """The autoencoder's round trip of the held-out and seen prompts' scenes, scored like generated pictures
    (logged and kept in `loss.json`). The DiT's pictures come out of the same decoder, so a colour pair the
    round trip miscolours is one the DiT will mostly miss too, whatever it learned."""
    rates = {}
    for name, scenes in (("held_out", held_out_prompts()), ("seen", seen_prompts())):
        rates[name] = hit_rates(round_trip(vae.encoder, vae.decoder, scenes, SIZE), scenes)
    history["round_trip"] = rates
    log(f"autoencoder round trip (background, shape colour, place): {rates}")


@torch.no_grad()
def encode_pool(vae: nn.Module, n: int, seed: int, device: torch.device) -> tuple[Tensor, list[Scene]]:
    """Raw posterior samples (N, z, 32, 32) bf16 of `n` fresh training scenes, and the scenes."""
    scenes = sample_scenes(n, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(0, n, 256):
        x = render(scenes[i : i + 256], SIZE, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_autocast(device)):
            moments = vae.encoder(x).float()
        mean, logvar = torch.chunk(moments, 2, dim=1)
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
        out.append((mean + std * torch.randn(mean.shape, generator=gen, device=device)).to(torch.bfloat16))
    return torch.cat(out), scenes


# ---- phase 2: the DiT -----------------------------------------------------------------------------------


@torch.no_grad()
def embed_pool(
    text: nn.Module, tokens: tuple[Tensor, ...], device: torch.device, chunk: int = 2048
) -> tuple[Tensor, ...]:
    """The frozen text encoders' outputs for every pooled caption, once: FLUX.1 (txt, pooled), FLUX.2 (txt,),
    in bf16 (what the DiT reads under autocast), so a training step runs no encoder."""
    parts: list[tuple[Tensor, ...]] = []
    for i in range(0, tokens[0].shape[0], chunk):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_autocast(device)):
            out = text(*(t[i : i + chunk] for t in tokens))
        parts.append(tuple(o.to(torch.bfloat16) for o in (out if isinstance(out, tuple) else (out,))))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


class Splice(NamedTuple):
    """Per pool entry, the two donors' token tensors (as `Flux1Text.tokens` / `KleinText.tokens` give) and the
    token index where each one's background phrase starts (`--splice`)."""

    head_tokens: tuple[Tensor, ...]
    tail_tokens: tuple[Tensor, ...]
    head_cut: Tensor  # (N,) int64
    tail_cut: Tensor  # (N,) int64


def background_starts(text: nn.Module, captions: list[str]) -> Tensor:
    """Per caption, the index of its first token after the words before its background phrase: where its
    T5 (FLUX.1) or Qwen3 (FLUX.2) sequence stops being the one of those words alone."""
    seq = -1 if isinstance(text, Flux1Text) else 0  # the sequence the DiT reads: T5's, or Qwen3's ids
    differ = text.tokens(captions)[seq] != text.tokens([background_cut(c) for c in captions])[seq]
    if not bool(differ.any(dim=1).all()):
        raise ValueError("a caption's tokens do not change at its background phrase")
    return differ.int().argmax(dim=1)


def make_splice(text: nn.Module, scenes: list[Scene], seed: int, device: torch.device) -> Splice:
    """The `--splice` donors of every pool scene (`tiny_scenes.splice_donors`), tokenized, with their cuts.
    Each distinct caption is tokenized once (60,000 scenes hold about 16,000 captions)."""
    parts = []
    for donors in splice_donors(scenes, seed):
        captions = [s.caption for s in donors]
        distinct = sorted(set(captions))
        where = {c: i for i, c in enumerate(distinct)}
        rows = torch.tensor([where[c] for c in captions])
        tokens = tuple(t[rows].to(device) for t in text.tokens(distinct))
        parts.append((tokens, background_starts(text, distinct)[rows].to(device)))
    (head_tokens, head_cut), (tail_tokens, tail_cut) = parts
    return Splice(head_tokens, tail_tokens, head_cut, tail_cut)


def splice_index(
    b: int, length: int, rows: Tensor, head_cut: Tensor, tail_cut: Tensor
) -> tuple[Tensor, Tensor]:
    """Gather indices (row, position), each (b, length), into text states stacked as [the batch's b rows |
    the m spliced rows' head donors | their tail donors]: a row of `rows` reads its head donor before
    `head_cut` and its tail donor from `tail_cut` on (the last state repeated once the tail runs out); every
    other row reads itself."""
    device = rows.device
    pos = torch.arange(length, device=device)
    src_row = torch.arange(b, device=device)[:, None].expand(b, length).clone()
    src_pos = pos[None].expand(b, length).clone()
    m = rows.numel()
    if m:
        k, kt = head_cut[:, None], tail_cut[:, None]
        donor = torch.arange(m, device=device)[:, None]
        before = pos[None] < k
        src_row[rows] = torch.where(before, b + donor, b + m + donor)
        src_pos[rows] = torch.where(before, pos[None], (kt + pos[None] - k).clamp(max=length - 1))
    return src_row, src_pos


def prefix_drift(states: Tensor, b: int, rows: Tensor, head_cut: Tensor, ids: Tensor) -> Tensor:
    """How far the spliced rows' own text states before the background phrase lie from their head donors'
    (the same words, another background: `--prefix-invariance`), as a mean squared difference over the donors'
    mean square. `states` and `ids` (b + 2m, L) hold the batch, then the m head donors (then the tail donors);
    only tokens before the phrase whose ids agree count (a caption with a part left out differs there). A causal
    encoder gives 0; a bidirectional one (FLUX.1's T5) mixes the background into every token, so a colour word
    beside a background it never met is a state the DiT never saw."""
    m = rows.numel()
    own, head = states[rows].float(), states[b : b + m].float()
    pos = torch.arange(states.shape[1], device=states.device)
    mask = (pos[None] < head_cut[:, None]) & (ids[rows] == ids[b : b + m])
    diff = (own - head).pow(2).mean(-1)
    return (diff * mask).sum() / mask.sum().clamp(min=1) / head.detach().pow(2).mean().clamp(min=1e-12)


class GuidanceTeacher:
    """FLUX.1 [dev]'s guidance distillation (`--guidance-distill F`), with the model as its own teacher.

    The teacher is a frozen copy of the DiT holding its EMA weights, refreshed every `refresh` steps (0: taken
    once, where distillation starts, and kept). Its
    guidance input is held at 1, the value the student's plain flow-matching rows are trained at. Those rows
    also drop a tenth of their captions to the empty prompt, so at guidance 1 the model learns both the
    conditional and the unconditional velocity. A distilled row asks the student, at a random guidance g,
    for what classifier-free guidance of the teacher gives: `v_u + g (v_c - v_u)` at the same noisy latent
    and time. That is how the dev model's guidance embedding gets a meaning; without it the input is fed
    random values and learns to be ignored."""

    def __init__(self, model: nn.Module, max_guidance: float, refresh: int = 100) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.max_guidance = max_guidance
        self.refresh = refresh

    def update(self, step: int, first: int, student: nn.Module, ema: EMA) -> None:
        if step == first or (self.refresh > 0 and step > first and (step - first) % self.refresh == 0):
            ema.copy_into(student, self.model)

    def guidance(self, n: int, gen: torch.Generator) -> Tensor:
        return 1 + (self.max_guidance - 1) * torch.rand(n, device=gen.device, generator=gen)

    @torch.no_grad()
    def targets(
        self, xt: Tensor, t: Tensor, cond: tuple[Tensor, Tensor], uncond: tuple[Tensor, Tensor], g: Tensor,
        img_ids: Tensor, txt_ids: Tensor, pe: Tensor,
    ) -> Tensor:  # fmt: skip
        """The guided velocity for rows (xt, t) whose text states are `cond` (txt, pooled), `uncond` being the
        empty prompt's (one row), at guidances `g`: both branches in one teacher call."""
        n = xt.shape[0]
        txt = torch.cat([cond[0], uncond[0].expand(n, -1, -1)]).float()
        pooled = torch.cat([cond[1], uncond[1].expand(n, -1)]).float()
        ones = torch.ones(2 * n, device=xt.device)
        v = self.model(xt.repeat(2, 1, 1), img_ids, txt, txt_ids, t.repeat(2), pooled, ones, pe=pe).float()
        v_c, v_u = v.chunk(2)
        return v_u + g[:, None, None] * (v_c - v_u)


def file_meta(seed: int) -> dict[str, str]:
    """The safetensors metadata of every weight file a run writes."""
    return {"format": "pt", "trained_by": "scripts/train_tiny.py", "seed": str(seed)}


def finish_autoencoder_only(
    vae: nn.Module, resumed: Path, earlier: dict, out: Path, history: dict, args: argparse.Namespace
) -> None:
    """Write the fine-tuned autoencoder beside unchanged copies of the resumed DiT, text encoders and
    statistics (`earlier`: the resumed run's log): the encoder did not move (`--decoder-only`) or was held
    near where it was on the training scenes (`--encoder-anchor`), so the latents the DiT was trained on
    mean what they meant."""
    flux1 = args.family == "flux1"
    for key in ("stats", "configs"):
        history[key] = earlier[key]
    save_file(bf16_state(vae, buffers=not flux1), out / "ae.safetensors", file_meta(args.seed))
    for item in resumed.iterdir():
        if item.name in ("ae.safetensors", "loss.json", "loss.png"):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, out / item.name)
    (out / "loss.json").write_text(json.dumps(history, indent=1))
    what = "decoder" if args.decoder_only else "autoencoder"
    plot_loss(history, out / "loss.png", f"tiny {'FLUX.1' if flux1 else 'FLUX.2'}: {what} fine-tuned")
    log(f"wrote {out} ({what} fine-tuned, the rest as in {resumed})")


def autoencoder_only(args: argparse.Namespace) -> bool:
    """Whether the run fine-tunes a resumed autoencoder alone (`--decoder-only`, `--encoder-anchor`) and copies
    the rest."""
    return args.decoder_only or args.encoder_anchor > 0


def carry_history(history: dict, earlier: dict, args: argparse.Namespace) -> None:
    """A resumed run's log continues the earlier one: its DiT rows (and, with the autoencoder kept, its VAE
    rows) come first, and this run's steps and seconds count on from where they ended."""
    last = earlier.get("dit", [])[-1:] or [{"step": -25, "time": 0.0}]
    history["resumed"] = {
        "from": str(args.resume), "args": earlier.get("args"), "dit_step": last[0]["step"] + 25,
        "dit_time": last[0]["time"],
    }  # fmt: skip
    history["dit"] = list(earlier.get("dit", []))
    if args.vae_steps == 0 or autoencoder_only(args):
        history["vae"] = list(earlier.get("vae", []))
        for key in ("round_trip", "encoder_drift"):  # what the kept autoencoder's own run measured
            if key in earlier:
                history[key] = earlier[key]


def train_dit(
    family: str,
    model: nn.Module,
    text: nn.Module,
    x0_pool: Tensor,
    fg_masks: Tensor,
    tokens: tuple[Tensor, ...],
    neg_tokens: tuple[Tensor, ...] | None,
    args: argparse.Namespace,
    device: torch.device,
    history: dict,
    splice: Splice | None = None,
    teacher: GuidanceTeacher | None = None,
) -> None:
    """Flow matching on the pool: `x0_pool` (N, L, C) normalised packed latents, `tokens` per pool entry.

    With `args.fg_weight` w > 0 each token's squared error is weighted 1 + w where `fg_masks` (N, L) marks
    a shape (the loss normalised by the weights' sum): the shape covers a few of the 256 tokens, so an
    unweighted loss is mostly the background's, which the models learned first and best.

    With `splice` (`--splice F`) a fraction F of each batch's rows (never an empty-prompt row) reads spliced
    text states (`splice_index`): the encoder runs on the batch and on those rows' donors in one call. With
    `args.prefix_invariance` W > 0 the loss adds W times `prefix_drift` of those rows, which trains the text
    encoder to code the words before the background phrase the same on every background.

    With `teacher` (FLUX.1, `--guidance-distill F`) a fraction F of each batch's rows, from step
    `args.distill_after` on, is trained on the teacher's guided velocity at a random guidance; the other rows
    are plain flow matching at guidance 1, a tenth of them on the empty prompt (`neg_tokens`)."""
    n, length, _ = x0_pool.shape
    side = 2 * math.isqrt(length)  # latent pixels per side; a token packs 2x2 of them
    if family == "flux1":
        img_ids = image_ids(side, side, dtype=torch.float32, device=device)
        txt_ids = torch.zeros(TEXT_LENGTH, 3, device=device)
        mu = FLUX1_DEV_SCHEDULE.mu(length, DEFAULT_STEPS)
    else:
        img_ids = flux2_image_ids(side, side, device=device)
        txt_ids = flux2_text_ids(TEXT_LENGTH, device=device)
        mu = FLUX2_SCHEDULE.mu(length, DEFAULT_STEPS)
    assert mu is not None
    log(f"dit: {n} pooled latents, {length} tokens, time shift mu {mu:.3f}")
    pe = model.rope(txt_ids, img_ids)
    frozen = args.freeze_text
    neg_cached: tuple[Tensor, ...] | None = None
    if frozen:  # the encoders stay as they are: their outputs for the pool (and the empty prompt) once
        text.eval().requires_grad_(False)
        cached = embed_pool(text, tokens, device)
        neg_cached = None if neg_tokens is None else embed_pool(text, neg_tokens, device)
        log(f"dit: text encoders frozen, {cached[0].shape[0]} captions embedded once")
    params = [p for p in (*model.parameters(), *text.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.dit_lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(nn.ModuleList([model, text]), args.ema)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 2)
    offset = history.get("resumed", {"dit_step": 0, "dit_time": 0.0})  # a resumed run's log counts on
    for step, elapsed in budgeted_steps("dit", opt, args.dit_steps, args.dit_seconds, args.dit_lr, 200):
        b = args.dit_batch
        idx = torch.randint(0, n, (b,), device=device, generator=gen)
        x0 = x0_pool[idx].float()
        batch_tokens = [t[idx] for t in (cached if frozen else tokens)]
        drop = torch.zeros(b, dtype=torch.bool, device=device)
        nd = 0  # distilled rows (the batch's first nd)
        if teacher is not None:
            teacher.update(step, args.distill_after, model, ema)
            nd = round(b * args.guidance_distill) if step >= args.distill_after else 0
        if neg_tokens is not None:  # caption dropout to the empty prompt (CFG's negative)
            drop = torch.rand(b, device=device, generator=gen) < 0.1
            drop &= torch.arange(b, device=device) >= nd
            negs = neg_cached if frozen else neg_tokens
            assert negs is not None
            batch_tokens = [
                torch.where(drop.view(-1, *([1] * (t.ndim - 1))), nt.expand_as(t), t)
                for t, nt in zip(batch_tokens, negs, strict=True)
            ]
        gather, drift = None, None
        uncond_row = nd > 0 and not frozen  # the empty prompt's states, for the teacher, as one more row
        if uncond_row:
            assert neg_tokens is not None
            batch_tokens = [torch.cat([t, nt]) for t, nt in zip(batch_tokens, neg_tokens, strict=True)]
        if splice is not None:  # spliced rows: their donors' tokens follow the batch's
            rows = ((torch.rand(b, device=device, generator=gen) < args.splice) & ~drop).nonzero().squeeze(1)
            src = idx[rows]
            batch_tokens = [
                torch.cat([t, h[src], tail[src]])
                for t, h, tail in zip(batch_tokens, splice.head_tokens, splice.tail_tokens, strict=True)
            ]
            gather = splice_index(b, TEXT_LENGTH, rows, splice.head_cut[src], splice.tail_cut[src])
            coin = torch.rand(rows.numel(), device=device, generator=gen) < 0.5
            pooled_src = torch.arange(b, device=device)
            pooled_src[rows] = b + torch.arange(rows.numel(), device=device) + rows.numel() * coin
        u = torch.sigmoid(torch.randn(b, device=device, generator=gen))
        t = shifted_t(u.clamp(1e-4, 1 - 1e-4), mu)
        noise = torch.randn(x0.shape, device=device, generator=gen)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        target = noise - x0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_autocast(device)):
            embedded = tuple(batch_tokens) if frozen else text(*batch_tokens)
            uncond = neg_cached
            if uncond_row:
                uncond = tuple(e[-1:].detach() for e in embedded)
                embedded = tuple(e[:-1] for e in embedded)
            if gather is not None:  # the spliced rows' states, each row's pooled state its own or a donor's
                states = embedded[0] if family == "flux1" else embedded
                if args.prefix_invariance > 0:  # the sequence the DiT reads: T5's ids, or Qwen3's
                    ids = batch_tokens[-1 if family == "flux1" else 0]
                    drift = prefix_drift(states, b, rows, splice.head_cut[src], ids)
                states = states[gather[0], gather[1]]
                embedded = (states, embedded[1][pooled_src]) if family == "flux1" else states
            if family == "flux1":
                txt, pooled = embedded
                if teacher is None:
                    guidance = 1 + 4 * torch.rand(b, device=device, generator=gen)
                else:
                    guidance = torch.ones(b, device=device)
                    guidance[:nd] = teacher.guidance(nd, gen)
                pred = model(xt, img_ids, txt.float(), txt_ids, t, pooled.float(), guidance, pe=pe)
                if nd > 0:
                    assert teacher is not None and uncond is not None
                    cond = (txt[:nd].detach(), pooled[:nd].detach())
                    guided = teacher.targets(
                        xt[:nd], t[:nd], cond, uncond, guidance[:nd], img_ids, txt_ids, pe
                    )
                    target = torch.cat([guided, target[nd:]])
            else:
                txt = embedded[0] if frozen else embedded
                pred = model(xt, img_ids, txt.float(), txt_ids, t, None, pe=pe)
        if args.fg_weight > 0:
            w = 1 + args.fg_weight * fg_masks[idx]
            loss = (w * (pred.float() - target).pow(2).mean(-1)).sum() / w.sum()
        else:
            loss = F.mse_loss(pred.float(), target)
        total = loss if drift is None else loss + args.prefix_invariance * drift
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update(step)
        if step % 25 == 0:
            row = {"step": step + offset["dit_step"], "time": round(elapsed + offset["dit_time"], 1)}
            more = {} if drift is None else {"prefix_drift": drift.item()}
            history["dit"].append({**row, "loss": loss.item(), **more})
        if step % 200 == 0:
            more = "" if drift is None else f" prefix drift {drift.item():.4f}"
            log(f"dit step {step}: loss {loss.item():.4f}{more} lr {opt.param_groups[0]['lr']:.2e}")
    ema.swap()  # ship the averaged weights


# ---- output ---------------------------------------------------------------------------------------------


def bf16_state(module: nn.Module, *, buffers: bool = False) -> dict[str, Tensor]:
    sd = dict(module.named_parameters())
    if buffers:
        sd.update(dict(module.named_buffers()))
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in sd.items()}


def load_text(text: nn.Module, folder: Path, flux1: bool) -> None:
    """The text encoders' weights from an earlier output folder (the transformers folders `save_text` wrote;
    `from_pretrained` restores tied weights that the files leave out)."""
    parts = [("clip", "text_encoder"), ("t5", "text_encoder_2")] if flux1 else [("model", "text_encoder")]
    for attr, sub in parts:
        model = getattr(text, attr)
        model.load_state_dict(type(model).from_pretrained(folder / sub).state_dict())
        log(f"resumed {attr} from {folder / sub}")


def save_text(folder: Path, model: nn.Module, tokenizer_dir: Path) -> None:
    """A transformers model folder (config.json, model.safetensors) with its tokenizer files beside."""
    model.to("cpu", torch.float32).save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)


def plot_loss(history: dict, path: Path, title: str) -> None:
    """Loss curves (VAE reconstruction, DiT flow-matching loss) as a PNG, with matplotlib if it is there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_with_pil(history, path, title)
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    for ax, key, field, label in (
        (axes[0], "vae", "rec", "VAE L1 + L2"),
        (axes[1], "dit", "loss", "DiT flow matching"),
    ):
        rows = history[key]
        if rows:
            ax.plot([r["step"] for r in rows], [r[field] for r in rows], lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_with_pil(history: dict, path: Path, title: str) -> None:
    """The same two panels drawn with PIL: log-scale loss against step, axes labelled at the decades."""
    from PIL import Image, ImageDraw

    w, h, pad = 420, 260, 40
    img = Image.new("RGB", (2 * w, h + 24), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 4), title, fill="black")
    for k, (key, field, label) in enumerate(
        (("vae", "rec", "VAE L1 + L2"), ("dit", "loss", "DiT flow matching"))
    ):
        rows = [r for r in history[key] if r[field] > 0]
        x0, y0 = k * w + pad, 24
        draw.rectangle([x0, y0, x0 + w - 2 * pad + 20, y0 + h - pad], outline="black")
        draw.text((x0 + 5, y0 + 3), label, fill="black")
        if len(rows) < 2:
            continue
        steps = [r["step"] for r in rows]
        logs = [math.log10(r[field]) for r in rows]
        lo, hi = math.floor(min(logs)), math.ceil(max(logs))
        hi = hi if hi > lo else lo + 1
        sx = (w - 2 * pad + 20) / max(1, max(steps))
        sy = (h - pad) / (hi - lo)
        pts = [(x0 + s * sx, y0 + (hi - v) * sy) for s, v in zip(steps, logs, strict=True)]
        draw.line(pts, fill=(31, 119, 180), width=1)
        for d in range(lo, hi + 1):
            y = y0 + (hi - d) * sy
            draw.text((x0 - 36, y - 6), f"1e{d}", fill="black")
        draw.text((x0 + w - 2 * pad - 40, y0 + h - pad + 4), f"step {max(steps)}", fill="black")
    img.save(path)


# ---- main -----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["flux1", "flux2"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vae-steps", type=int, default=3000)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--vae-lr", type=float, default=1e-3)
    ap.add_argument("--vae-seconds", type=float, default=110.0)
    ap.add_argument("--kl-weight", type=float, default=1e-4)
    ap.add_argument(
        "--vae-rgb",
        type=float,
        default=0.0,
        help="fraction of each autoencoder batch painted in random colours (tiny_scenes.random_rgb), so it "
        "codes colour pairs its scenes never combine",
    )
    ap.add_argument(
        "--vae-rgb-extremes",
        type=float,
        default=0.0,
        help="with --vae-rgb: the chance that each channel of a random colour is drawn from its outer 15 %% "
        "(tiny_scenes.random_rgb's extremes), so the random pairs reach saturated colours, white and black",
    )
    ap.add_argument(
        "--decoder-only",
        action="store_true",
        help="with --resume: train the autoencoder's decoder alone and keep everything else as resumed (the "
        "encoder, so the latents and statistics the DiT learned, the DiT and the text encoders)",
    )
    ap.add_argument(
        "--encoder-anchor",
        type=float,
        default=0.0,
        metavar="W",
        help="with --resume: train the whole autoencoder, adding W times the encoder's relative drift on the "
        "batch's palette scenes (mean squared change of its posterior means over their variance) to the loss, "
        "so the latents the DiT learned stay near what they were; the rest is kept as resumed",
    )
    ap.add_argument("--pool", type=int, default=60000)
    ap.add_argument("--dit-steps", type=int, default=6000)
    ap.add_argument("--dit-batch", type=int, default=128)
    ap.add_argument("--dit-lr", type=float, default=5e-4)
    ap.add_argument("--dit-seconds", type=float, default=300.0)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument(
        "--fg-weight",
        type=float,
        default=0.0,
        help="weight the squared error of the tokens a shape covers by 1 + this (0: the plain mean)",
    )
    ap.add_argument(
        "--caption-drop",
        type=float,
        default=0.0,
        metavar="F",
        help="a fraction F of the pool's captions leave one part out (the shape colour word, the background "
        "phrase or the place phrase; tiny_scenes.partial_captions), so each part alone says what it says",
    )
    ap.add_argument(
        "--splice",
        type=float,
        default=0.0,
        metavar="F",
        help="a fraction F of each batch reads text states spliced at the background phrase from two donor "
        "captions (the same scene on another background, then with another shape colour), so each colour is "
        "read from its own phrase",
    )
    ap.add_argument(
        "--prefix-invariance",
        type=float,
        default=0.0,
        metavar="W",
        help="with --splice: add W times the spliced rows' prefix drift (their text states before the "
        "background phrase against the same words on another background) to the loss, so a bidirectional "
        "text encoder (FLUX.1's T5) codes the colour word the same on every background",
    )
    ap.add_argument(
        "--guidance-distill",
        type=float,
        default=0.0,
        metavar="F",
        help="FLUX.1: a fraction F of each batch learns the model's own classifier-free guidance at a random "
        "guidance g (the target v_u + g (v_c - v_u) from an EMA copy at guidance 1), the other rows plain flow "
        "matching at guidance 1 with a tenth of captions dropped to the empty prompt",
    )
    ap.add_argument(
        "--distill-after",
        type=int,
        default=300,
        metavar="N",
        help="with --guidance-distill: distil from step N on (before it, only the plain rows, so the empty "
        "prompt's branch is learned first)",
    )
    ap.add_argument(
        "--distill-max-guidance",
        type=float,
        default=5.0,
        help="with --guidance-distill: the distilled rows' guidance is uniform in [1, this]",
    )
    ap.add_argument(
        "--teacher-refresh",
        type=int,
        default=100,
        metavar="N",
        help="with --guidance-distill: copy the EMA weights into the teacher every N steps (0: once, where "
        "distillation starts, then the teacher stays frozen)",
    )
    ap.add_argument("--resume", type=Path, default=None, help="an earlier output folder to start from")
    ap.add_argument(
        "--freeze-text",
        action="store_true",
        help="keep the text encoders as they are (with --resume: the shipped ones) and embed the pool's "
        "captions once, so each DiT step runs no encoder",
    )
    args = ap.parse_args()
    tune = "--decoder-only" if args.decoder_only else "--encoder-anchor" if args.encoder_anchor > 0 else None
    if args.decoder_only and args.encoder_anchor > 0:
        ap.error("--decoder-only keeps the encoder frozen and --encoder-anchor trains it: pick one")
    if tune and (args.resume is None or not (args.resume / "loss.json").is_file()):
        ap.error(
            f"{tune} fine-tunes an earlier run's autoencoder: add --resume FOLDER (a folder this "
            "script wrote, with its loss.json)"
        )
    if not 0 <= args.caption_drop <= 1:
        ap.error(f"--caption-drop is a fraction of the captions, in [0, 1] (got {args.caption_drop})")
    if not 0 <= args.splice <= 1:
        ap.error(f"--splice is a fraction of each batch, in [0, 1] (got {args.splice})")
    if args.prefix_invariance < 0 or (args.prefix_invariance > 0 and args.splice == 0):
        ap.error(
            f"--prefix-invariance W needs W >= 0 (got {args.prefix_invariance}) and --splice F > 0 (its donors)"
        )
    if not 0 <= args.guidance_distill <= 1:
        ap.error(f"--guidance-distill is a fraction of each batch, in [0, 1] (got {args.guidance_distill})")
    if args.guidance_distill > 0 and args.family != "flux1":
        ap.error("--guidance-distill trains FLUX.1 [dev]'s guidance embedding; FLUX.2 [klein] runs real CFG")
    if args.guidance_distill > 0 and args.splice > 0:
        ap.error("--guidance-distill and --splice both claim rows of each batch: pick one")
    if args.distill_max_guidance < 1 or args.distill_after < 0 or args.teacher_refresh < 0:
        ap.error("--distill-max-guidance must be >= 1, --distill-after and --teacher-refresh >= 0")
    if args.splice > 0 and args.freeze_text:
        ap.error("--splice splices the text encoders' states as they run: drop --freeze-text")
    if not 0 <= args.vae_rgb_extremes <= 1 or (args.vae_rgb_extremes > 0 and args.vae_rgb == 0):
        ap.error(
            f"--vae-rgb-extremes is a chance in [0, 1] (got {args.vae_rgb_extremes}) and needs --vae-rgb F > 0"
        )
    if args.encoder_anchor < 0:
        ap.error(f"--encoder-anchor must be >= 0 (got {args.encoder_anchor}); 0 turns it off")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    history: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "vae": [], "dit": []}
    flux1 = args.family == "flux1"
    earlier: dict = {}
    if args.resume is not None and (args.resume / "loss.json").is_file():
        earlier = json.loads((args.resume / "loss.json").read_text())
        carry_history(history, earlier, args)

    # the autoencoder
    vae_cfg = TINY_TRAINED_VAE if flux1 else TINY_FLUX2_TRAINED_VAE
    torch.manual_seed(args.seed)
    vae = (Flux1VAE if flux1 else Flux2VAE)(vae_cfg).to(device)
    if args.resume is not None:
        vae.load_state_dict({k: v.float() for k, v in load_file(args.resume / "ae.safetensors").items()})
    ae_only = autoencoder_only(args)
    first = history["vae"][-1]["step"] + 25 if ae_only and history["vae"] else 0
    train_vae(vae, args, device, history, first)
    vae.eval().requires_grad_(False)
    if args.vae_steps > 0:  # a kept autoencoder's: eval_tiny.py --autoencoder
        log_round_trip(vae, history)
    if ae_only:
        finish_autoencoder_only(vae, args.resume, earlier, out, history, args)
        return
    save_file(bf16_state(vae), out / "ae.safetensors")  # kept if the DiT phase fails

    # its latents on a pool of scenes, and their statistics
    raw, scenes = encode_pool(vae, args.pool, args.seed * 1000 + 3, device)
    captions = partial_captions(scenes, args.caption_drop, args.seed * 1000 + 4)  # all whole when 0
    fg_masks = torch.from_numpy(token_masks(scenes, raw.shape[-1] // 2)).to(device)  # 2x2 latent px a token
    stats: dict = {}
    if flux1:
        mean, std = raw.float().mean().item(), raw.float().std().item()
        stats = {"shift_factor": round(mean, 4), "scale_factor": round(1 / std, 4)}
        if args.resume is not None and args.vae_steps == 0:
            # the autoencoder is the shipped one: train against the statistics its preset carries
            stats = {"shift_factor": vae_cfg.shift_factor, "scale_factor": vae_cfg.scale_factor}
            log(
                f"FLUX.1 latent statistics kept from the preset: {stats} (measured {mean:.4f}, {1 / std:.4f})"
            )
        else:
            log(f"FLUX.1 latent statistics: {stats} (the VAE preset must carry these)")
        x0 = pack(((raw.float() - stats["shift_factor"]) * stats["scale_factor"]).to(torch.bfloat16))
    else:
        p = patchify(raw.float())  # (N, 128, 16, 16)
        if args.resume is not None and args.vae_steps == 0:  # the shipped autoencoder's own statistics
            bn_mean, bn_var = vae.bn.running_mean.clone(), vae.bn.running_var.clone()
            log("FLUX.2 BatchNorm statistics kept from the resumed autoencoder")
        else:
            bn_mean, bn_var = p.mean(dim=(0, 2, 3)), p.var(dim=(0, 2, 3))
            vae.bn.running_mean.copy_(bn_mean)
            vae.bn.running_var.copy_(bn_var)
        eps = vae_cfg.batch_norm_eps
        x0 = flux2_pack(
            ((p - bn_mean[None, :, None, None]) / torch.sqrt(bn_var[None, :, None, None] + eps)).to(
                torch.bfloat16
            )
        )
        stats = {"bn_mean_abs": bn_mean.abs().mean().item(), "bn_var_mean": bn_var.mean().item()}
    del raw

    # text encoders and the DiT
    text = Flux1Text(args.seed) if flux1 else KleinText(args.seed)
    if args.resume is not None:  # the encoders the resumed DiT was trained against
        load_text(text, args.resume, flux1)
    text.to(device).train()
    tokens = tuple(t.to(device) for t in text.tokens(captions))
    splice = make_splice(text, scenes, args.seed * 1000 + 5, device) if args.splice > 0 else None
    del scenes
    distil = args.guidance_distill > 0
    neg = tuple(t.to(device) for t in text.tokens([NEGATIVE_PROMPT])) if distil or not flux1 else None
    dit_cfg = TINY_TRAINED if flux1 else TINY_FLUX2_TRAINED
    model = (Flux1Transformer if flux1 else Flux2Transformer)(dit_cfg)
    init_dit(model, args.seed)
    model.to(device).train()
    if args.resume is not None:
        dit_file = "flux1-tiny.safetensors" if flux1 else "flux2-tiny.safetensors"
        model.load_state_dict({k: v.float() for k, v in load_file(args.resume / dit_file).items()})
    teacher = GuidanceTeacher(model, args.distill_max_guidance, args.teacher_refresh) if distil else None
    train_dit(args.family, model, text, x0, fg_masks, tokens, neg, args, device, history, splice, teacher)

    # write what the runtime loads
    model.eval()
    meta = file_meta(args.seed)
    save_file(
        bf16_state(model), out / ("flux1-tiny.safetensors" if flux1 else "flux2-tiny.safetensors"), meta
    )
    save_file(bf16_state(vae, buffers=not flux1), out / "ae.safetensors", meta)
    if flux1:
        save_text(out / "text_encoder", text.clip, tiny_tokenizer_path("clip"))
        save_text(out / "text_encoder_2", text.t5, tiny_tokenizer_path("t5"))
    else:
        save_text(out / "text_encoder", text.model, TINY_TOKENIZERS / "qwen3")
    history["stats"] = stats
    history["configs"] = {"dit": asdict(dit_cfg), "vae": asdict(vae_cfg)}
    (out / "loss.json").write_text(json.dumps(history, indent=1))
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    plot_loss(history, out / "loss.png", f"tiny {'FLUX.1' if flux1 else 'FLUX.2'}: seed {args.seed}")
    log(f"wrote {out}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
