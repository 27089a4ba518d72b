"""The tiny models' scorer is right on rendered ground truth, and its place measures can tell following from
ignoring (scripts/tiny_scenes.py; the numbers of scripts/eval_tiny.py rest on these)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from scripts.tiny_scenes import (
    PLACES,
    SEEN_COLOURS,
    Scene,
    background_colour,
    centre,
    held_out_prompts,
    is_held_out,
    partial_captions,
    place_following,
    place_sweeps,
    random_rgb,
    render,
    round_trip,
    sample_scenes,
    score,
    seen_prompts,
    shape_colour,
    splice_donors,
    token_masks,
)


def _pictures(scenes: list) -> list[np.ndarray]:
    x = render(scenes, 128)
    return list(((x + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy())


@pytest.mark.parametrize("scenes", [held_out_prompts(1), seen_prompts(14)], ids=["held-out", "seen"])
def test_scorer_passes_the_rendered_scenes(scenes: list) -> None:
    for image, scene in zip(_pictures(scenes), scenes, strict=True):
        got = score(image, scene)
        assert got.background and got.colour and got.place, (scene.caption, got)
        assert background_colour(image) == scene.background


def test_shape_colour_reads_the_painted_colour_and_the_misses_name_it() -> None:
    """A scene rendered in another colour than its caption asks: the scorer marks the colour wrong, and
    `shape_colour` (what eval_tiny.py's misses report) says which colour it came out in."""
    from scripts import eval_tiny

    asked = held_out_prompts(1)[:3]
    other = [next(c for c in ("green", "red", "blue") if c not in (s.colour, s.background)) for s in asked]
    painted = [replace(s, colour=c) for s, c in zip(asked, other, strict=True)]
    pictures = _pictures(painted)
    for image, scene, drawn in zip(pictures, asked, painted, strict=True):
        assert shape_colour(image, scene.background) == drawn.colour
    blank = np.zeros_like(pictures[0])  # all black: no shape on a black background
    assert shape_colour(blank, "black") is None
    missed = eval_tiny.misses(pictures, asked)
    assert [m["caption"] for m in missed] == [s.caption for s in asked]
    assert all("colour" in m["wrong"] for m in missed)
    assert [m["shape_colour"] for m in missed] == [s.colour for s in painted]
    assert eval_tiny.misses(_pictures(asked), asked) == []


def test_captions_take_the_right_article() -> None:
    scene = Scene(1, "", "orange", "cross", None, "orange", True, ((0.5, 0.5),), 0.13)
    assert scene.caption == "an orange cross on an orange gradient"
    assert replace(scene, background="red", size="small").caption == "a small orange cross on a red gradient"


def test_partial_captions_leave_out_one_part_and_keep_the_rest_in_order() -> None:
    """`--caption-drop`'s captions: with fraction 0 every caption is whole; otherwise about that fraction
    leave out exactly one part (the colour word, the background phrase, or the place phrase), and what is
    left is the whole caption with that part cut out, so every caption still describes its picture."""
    scenes = sample_scenes(600, 5) + held_out_prompts(2)
    assert partial_captions(scenes, 0.0, 1) == [s.caption for s in scenes]
    got = partial_captions(scenes, 0.5, 1)
    changed = [(s, c) for s, c in zip(scenes, got, strict=True) if c != s.caption]
    assert 0.4 * len(scenes) < len(changed) < 0.6 * len(scenes)
    seen_parts = set()
    for scene, caption in changed:
        parts = [p for p in ("colour", "background", "place") if caption == scene.describe(p)]
        assert len(parts) == 1, (scene.caption, caption)
        seen_parts.add(parts[0])
        whole, cut = scene.caption.split(), caption.split()
        assert all(w in whole for w in cut) and len(cut) < len(whole)
    assert seen_parts == {"colour", "background", "place"}
    scene = Scene(1, "small", "green", "square", "top left", "white", False, ((0.25, 0.25),), 0.085)
    assert scene.describe("colour") == "a small square at the top left on a white background"
    assert scene.describe("background") == "a small green square at the top left"
    assert scene.describe("place") == "a small green square on a white background"
    assert replace(scene, place=None).describe("place") == replace(scene, place=None).caption


def test_seen_prompts_are_placed_training_combinations() -> None:
    scenes = seen_prompts(60)
    assert len(scenes) == 60 and len({s.caption for s in scenes}) > 40
    assert all(s.count == 1 and s.place is not None and not is_held_out(s) for s in scenes)


def test_place_following_is_one_for_rendered_sweeps_and_zero_for_a_fixed_shape() -> None:
    group = place_sweeps(1)[0]
    assert [s.place for s in group] == list(PLACES) and len({s.colour for s in group}) == 1
    found = [centre(image, s.colour) for image, s in zip(_pictures(group), group, strict=True)]
    assert place_following(found, group) == pytest.approx(1.0, abs=0.03)
    assert place_following([found[0]] * len(group), group) == pytest.approx(0.0, abs=1e-9)
    assert place_following([None] * len(group), group) == pytest.approx(0.0, abs=1e-9)


def test_token_masks_cover_every_token_a_shape_touches_and_few_others() -> None:
    """Rendered at 256 px and cut into the DiT's 16 x 16 tokens of 16 px: a token whose pixels differ from
    the background holds a shape, and its mask entry is 1; the masks stay under a third of each picture."""
    scenes = seen_prompts(14) + held_out_prompts(1)[:10]
    masks = token_masks(scenes, 16)
    x = render(scenes, 256)
    for scene, image, mask in zip(scenes, x, masks, strict=True):
        plain = render([replace(scene, centres=())], 256)[0]
        touched = ((image - plain).abs().amax(0) > 1e-3).reshape(16, 16, 16, 16).any(dim=(1, 3))
        assert bool((mask.reshape(16, 16)[touched.numpy()] == 1).all()), scene.caption
        # a large shape's reach (0.19 * sqrt(2) + half a token) spans at most 0.31 of the side: 30 % of tokens
        assert 0 < mask.sum() <= 0.32 * mask.size, (scene.caption, mask.sum())


def test_random_colours_are_apart_and_paint_the_scene() -> None:
    shape, background = random_rgb(64, seed=3)
    again = random_rgb(64, seed=3)
    assert torch.equal(shape, again[0]) and torch.equal(background, again[1])
    assert shape.shape == background.shape == (64, 3) and shape.min() >= 0 and shape.max() <= 1
    assert ((shape - background).norm(dim=1) >= 0.3).all()
    scene = Scene(1, "large", "red", "square", "centre", "blue", False, ((0.5, 0.5),), 0.19)
    x = render([scene], 64, rgb=(shape[:1], background[:1]))
    assert torch.allclose((x[0, :, 32, 32] + 1) / 2, shape[0], atol=1e-6)  # the shape's middle
    assert torch.allclose((x[0, :, 1, 1] + 1) / 2, background[0], atol=1e-6)  # a corner


def test_random_colours_reach_the_extremes_when_asked() -> None:
    """`extremes` moves channels to their outer 15 % (near-white backgrounds become common) and 0 draws as
    the default does."""
    plain, plain_bg = random_rgb(512, seed=5)
    same = random_rgb(512, seed=5, extremes=0.0)
    assert torch.equal(plain, same[0]) and torch.equal(plain_bg, same[1])
    shape, background = random_rgb(512, seed=5, extremes=0.6)
    assert ((shape - background).norm(dim=1) >= 0.3).all() and shape.min() >= 0 and background.max() <= 1

    def outer(c: torch.Tensor) -> float:
        return ((c < 0.15) | (c > 0.85)).float().mean().item()

    def near_white(c: torch.Tensor) -> int:
        return int(((c - 0.96).norm(dim=1) < 0.15).sum())

    assert outer(plain) < 0.4 < outer(shape)  # uniform: 0.3 of the channels; here about 0.72
    assert near_white(plain_bg) < 10 < near_white(background)  # 3 and 26 of 512


class _Halves(torch.nn.Module):
    """An encoder whose posterior mean is its input (the log-variance half zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros_like(x)], dim=1)


def test_round_trip_through_a_lossless_autoencoder_scores_like_the_scenes() -> None:
    """The round trip keeps the means and decodes them: with an identity decoder every held-out scene comes
    back scoring right, and a decoder that swaps red and blue gets the colours wrong."""
    scenes = held_out_prompts(1)
    identity = torch.nn.Conv2d(3, 3, 1, bias=False)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(3)[:, :, None, None])
    for image, scene in zip(round_trip(_Halves(), identity, scenes, 128), scenes, strict=True):
        assert image.dtype == np.uint8 and image.shape == (128, 128, 3)
        got = score(image, scene)
        assert got.background and got.colour, scene.caption
    swap = torch.nn.Conv2d(3, 3, 1, bias=False)
    with torch.no_grad():
        swap.weight.copy_(torch.eye(3)[[2, 1, 0]][:, :, None, None])
    swapped = round_trip(_Halves(), swap, scenes, 128)
    assert not all(score(p, s).colour for p, s in zip(swapped, scenes, strict=True))


def test_swap_donors_are_seen_pairs_that_keep_one_colour_each() -> None:
    from scripts.eval_tiny import swap_donors

    for scene in held_out_prompts(1)[:8]:
        shape_donor, background_donor = swap_donors(scene)
        assert shape_donor == replace(scene, background=shape_donor.background)
        assert background_donor == replace(scene, colour=background_donor.colour)
        for d in (shape_donor, background_donor):
            assert (d.colour, d.background) in SEEN_COLOURS and not is_held_out(d)


@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_spliced_text_is_the_own_embedding_with_itself_as_donor_and_takes_each_part_from_its_donor(
    model: str,
) -> None:
    """`eval_tiny.spliced_text` on the shipped tiny models: the scenes as their own donors give the captions'
    own embeddings bit for bit; with `swap_donors`, the tokens before the background phrase are the shape
    donor's (for FLUX.2's causal Qwen3 also the scene's own), the background phrase the background donor's,
    and FLUX.1's pooled state the scene's."""
    from flux_runtime.pipeline import Pipeline
    from scripts.eval_tiny import spliced_text, swap_donors

    pipe = Pipeline.from_pretrained(model, device="cpu")
    te, flux1 = pipe.text_encoder, model == "tiny"
    scenes = held_out_prompts(1)[:8]

    def encode(captions: list[str]) -> torch.Tensor:
        return te.encode(captions, max_sequence_length=64, device="cpu")

    def cut(caption: str) -> int:
        def ids(text: str) -> list[int]:
            return te.t5_tokenizer(text)["input_ids"] if flux1 else te.tokenize([text], 64)[0][0].tolist()

        whole, head = ids(caption), ids(caption[: caption.rindex(" on a")])
        return next(i for i, (x, y) in enumerate(zip(whole, head, strict=False)) if x != y)

    own = encode([s.caption for s in scenes])
    embeds, pooled = spliced_text(pipe, scenes, scenes, scenes)
    assert torch.equal(embeds, own.prompt_embeds)
    assert torch.equal(pooled, own.pooled_prompt_embeds) if flux1 else pooled is None
    donors = [swap_donors(s) for s in scenes]
    embeds, pooled = spliced_text(pipe, scenes, [d[0] for d in donors], [d[1] for d in donors])
    if flux1:
        assert torch.equal(pooled, own.pooled_prompt_embeds)
    for i, (scene, (shape_donor, background_donor)) in enumerate(zip(scenes, donors, strict=True)):
        k, kb = cut(scene.caption), cut(background_donor.caption)
        assert 5 < k < 40
        assert torch.equal(embeds[i, :k], encode([shape_donor.caption]).prompt_embeds[0, :k])
        if not flux1:  # causal: the words before the background phrase do not see it
            assert torch.equal(embeds[i, :k], own.prompt_embeds[i, :k])
        n = min(64 - k, 64 - kb)
        assert torch.equal(
            embeds[i, k : k + n], encode([background_donor.caption]).prompt_embeds[0, kb : kb + n]
        )
        assert not torch.equal(embeds[i], own.prompt_embeds[i])


def test_splice_donors_are_training_scenes_that_keep_one_colour_each() -> None:
    scenes = sample_scenes(200, 3)
    heads, tails = splice_donors(scenes, 5)
    assert (heads, tails) == splice_donors(scenes, 5)
    for scene, head, tail in zip(scenes, heads, tails, strict=True):
        assert head == replace(scene, background=head.background) and head.background != scene.background
        assert tail == replace(scene, colour=tail.colour) and tail.colour != scene.colour
        assert not is_held_out(head) and not is_held_out(tail)
    assert len({h.background for h in heads}) == 8 and len({t.colour for t in tails}) == 8


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_splice_rows_read_the_head_donor_then_the_tail_donor(family: str) -> None:
    """`train_tiny --splice`: each caption's background phrase starts where the eval's text swap cuts it, the
    donors' tokens and cuts are each caption's own (tokenized once per distinct caption), and a spliced row
    gathers its head donor's states before that token and its tail donor's from the tail's cut on (padded with
    the last state); the other rows gather their own states unchanged."""
    from scripts.train_tiny import Flux1Text, KleinText, background_starts, make_splice, splice_index

    text = Flux1Text(0) if family == "flux1" else KleinText(0)
    scenes = sample_scenes(6, 11)
    heads, tails = splice_donors(scenes, 2)
    captions = [s.caption for s in scenes]
    cuts = background_starts(text, captions)
    for caption, k in zip(captions, cuts.tolist(), strict=True):
        ids = text.tokens([caption, caption[: caption.rindex(" on a")]])[-1 if family == "flux1" else 0]
        assert torch.equal(ids[0, :k], ids[1, :k]) and ids[0, k] != ids[1, k] and 3 < k < 40
    splice = make_splice(text, scenes, 2, torch.device("cpu"))  # each distinct caption tokenized once
    for donors, tokens, cut in ((heads, splice.head_tokens, splice.head_cut), (tails, splice.tail_tokens, splice.tail_cut)):  # fmt: skip
        want = text.tokens([d.caption for d in donors])
        assert all(torch.equal(a, w) for a, w in zip(tokens, want, strict=True))
        assert torch.equal(cut, background_starts(text, [d.caption for d in donors]))
    b, length, m = len(scenes), 64, 2
    rows = torch.tensor([1, 4])
    head_cut, tail_cut = splice.head_cut[rows], splice.tail_cut[rows]
    states = torch.randn(b + 2 * m, length, 3)
    src_row, src_pos = splice_index(b, length, rows, head_cut, tail_cut)
    out = states[src_row, src_pos]
    for i in (0, 2, 3, 5):
        assert torch.equal(out[i], states[i])
    for j, i in enumerate(rows.tolist()):
        k, kt = int(head_cut[j]), int(tail_cut[j])
        assert torch.equal(out[i, :k], states[b + j, :k])
        n = min(length - kt, length - k)
        assert torch.equal(out[i, k : k + n], states[b + m + j, kt : kt + n])
        assert (out[i, k + n :] == states[b + m + j, -1]).all()


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_prefix_drift_is_zero_for_a_causal_encoder_and_not_for_t5(family: str) -> None:
    """`train_tiny --prefix-invariance`'s term on a batch whose rows are all spliced: Qwen3 (causal) codes the
    words before the background phrase the same on any background, so the drift is 0 (exactly,
    in fp32 on the CPU); T5 (bidirectional) does not, and the drift has a gradient into the encoder."""
    from scripts.train_tiny import Flux1Text, KleinText, make_splice, prefix_drift

    text = Flux1Text(0) if family == "flux1" else KleinText(0)
    scenes = sample_scenes(4, 7)
    splice = make_splice(text, scenes, 3, torch.device("cpu"))
    rows = torch.arange(4)
    tokens = [
        torch.cat([t, h, tail])
        for t, h, tail in zip(text.tokens([s.caption for s in scenes]), splice.head_tokens, splice.tail_tokens, strict=True)
    ]  # fmt: skip
    out = text(*tokens)
    states = out[0] if family == "flux1" else out
    drift = prefix_drift(states, 4, rows, splice.head_cut, tokens[-1 if family == "flux1" else 0])
    if family == "flux2":
        assert drift.item() < 1e-10
    else:
        assert drift.item() > 1e-3
        drift.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in text.t5.parameters())
    same = prefix_drift(
        torch.cat([states[:4], states[:4]]), 4, rows, splice.head_cut, torch.cat([tokens[-1][:4]] * 2)
    )
    assert same.item() == 0


@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_prefix_change_sees_t5_mix_the_background_in_and_qwen3_not(model: str) -> None:
    """`eval_tiny.prefix_change` on the shipped encoders: Qwen3's states before the background phrase do not move
    when only the background changes; T5's do, and both move when the shape colour changes."""
    from flux_runtime.pipeline import Pipeline
    from scripts.eval_tiny import prefix_change

    pipe = Pipeline.from_pretrained(model, device="cpu")
    change = prefix_change(pipe, held_out_prompts(1)[:4])
    assert change["colour"] > 0.1
    assert change["background"] == 0 if model == "tiny-flux2" else change["background"] > 0.1


def test_guidance_teacher_targets_are_cfg_of_its_ema_copy_at_guidance_one() -> None:
    """`train_tiny --guidance-distill`: the teacher holds the EMA's averages (not the live weights), and its
    target at guidance g is `v_u + g (v_c - v_u)` of its own velocities at guidance 1: g = 1 gives the
    conditional velocity, g = 0 the unconditional one, and the target is linear in g."""
    from flux_runtime.models.dit import Flux1Transformer
    from flux_runtime.models.dit.config import TINY_TRAINED
    from flux_runtime.sampling.latents import image_ids
    from scripts.train_tiny import EMA, GuidanceTeacher, init_dit

    torch.manual_seed(0)
    model = Flux1Transformer(TINY_TRAINED).float()
    init_dit(model, 0)
    with torch.no_grad():  # the zero-initialised output layers would make every velocity 0
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ema = EMA(model, 0.5)
    teacher = GuidanceTeacher(model, 5.0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # the live weights move; the average moves half as far (decay 0.5 from step 9)
    ema.update(9)
    teacher.update(0, 0, model, ema)
    for p, s, q in zip(model.parameters(), ema.shadow, teacher.model.parameters(), strict=True):
        assert torch.equal(q, s) and not torch.equal(q, p)
    assert not any(q.requires_grad for q in teacher.model.parameters())
    frozen = GuidanceTeacher(model, 5.0, refresh=0)  # taken once where distillation starts, then kept
    frozen.update(300, 300, model, ema)
    kept = [q.clone() for q in frozen.model.parameters()]
    ema.update(10)  # the average moves on; a refreshing teacher follows it at its next refresh
    frozen.update(400, 300, model, ema)
    teacher.update(100, 0, model, ema)
    assert all(torch.equal(q, k) for q, k in zip(frozen.model.parameters(), kept, strict=True))
    assert all(torch.equal(q, s) for q, s in zip(teacher.model.parameters(), ema.shadow, strict=True))
    assert not all(torch.equal(q, k) for q, k in zip(teacher.model.parameters(), kept, strict=True))

    n, side = 3, 4
    img_ids = image_ids(side, side, dtype=torch.float32, device=torch.device("cpu"))
    txt_ids = torch.zeros(5, 3)
    pe = teacher.model.rope(txt_ids, img_ids)
    width = TINY_TRAINED.context_in_dim
    xt = torch.randn(n, (side // 2) ** 2, TINY_TRAINED.in_channels)
    t = torch.rand(n)
    cond = (torch.randn(n, 5, width), torch.randn(n, TINY_TRAINED.vec_in_dim))
    uncond = (torch.randn(1, 5, width), torch.randn(1, TINY_TRAINED.vec_in_dim))

    def velocity(txt: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return teacher.model(xt, img_ids, txt, txt_ids, t, pooled, torch.ones(n), pe=pe)

    v_c, v_u = velocity(*cond), velocity(uncond[0].expand(n, -1, -1), uncond[1].expand(n, -1))
    assert not torch.allclose(v_c, v_u, atol=1e-4)
    at = {
        g: teacher.targets(xt, t, cond, uncond, torch.full((n,), g), img_ids, txt_ids, pe)
        for g in (0.0, 1.0, 3.0)
    }
    torch.testing.assert_close(at[1.0], v_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(at[0.0], v_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(at[3.0], v_u + 3 * (v_c - v_u), rtol=1e-4, atol=1e-5)
