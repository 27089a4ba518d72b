"""flux-gen on the built-in tiny model: files, provenance, replay, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from tests.cli.gen_helpers import assert_replays, pixels, record

BASE = ["--model", "tiny", "--height", "32", "--width", "48", "--steps", "2", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def test_writes_png_with_provenance(tmp_path):
    out = tmp_path / "fox.png"
    res = _run("--prompt", "a red fox", "--seed", "5", "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        assert im.size == (48, 32)
        info = json.loads(im.text["flux_runtime"])
    assert info["prompt"] == "a red fox" and info["seed"] == 5 and info["num_steps"] == 2
    assert info["quality"] == "lossless" and info["model"] == "tiny"
    assert info["weights"].startswith("tiny-trained-")  # the shipped trained weights, by content
    assert {"torch", "flux_runtime", "device", "guidance", "dtype"} <= info.keys()


def test_replay_regenerates_the_same_pixels(tmp_path):
    first, again = tmp_path / "a", tmp_path / "again.png"
    assert (
        _run("--prompt", "a red fox", "--num-images", "2", "--seed", "3", "--out", str(first)).exit_code == 0
    )
    second = first / "flux-3-1.png"
    assert_replays(second, again)
    assert not np.array_equal(pixels(second), pixels(first / "flux-3-0.png"))


def test_replaying_any_image_of_a_batch_runs_the_recorded_batch(tmp_path):
    """Image i of a 3-image batch replays from the whole batch: a batch of i + 1 rounds its GEMMs otherwise
    (on an AVX2 CPU, every image of a 4-image tiny batch replayed from a smaller one was a level off)."""
    first = tmp_path / "a"
    assert (
        _run("--prompt", "a red fox", "--num-images", "3", "--seed", "3", "--out", str(first)).exit_code == 0
    )
    for i in (0, 1):
        made, again = first / f"flux-3-{i}.png", tmp_path / f"again{i}.png"
        assert_replays(made, again)
        assert (record(again)["index"], record(again)["num_images"]) == (i, 3)


def test_replaying_a_served_batch_image_warns_the_pixels_may_differ(tmp_path):
    from PIL.PngImagePlugin import PngInfo

    made = tmp_path / "a.png"
    assert _run("--prompt", "a red fox", "--out", str(made)).exit_code == 0
    meta = PngInfo()
    meta.add_text("flux_runtime", json.dumps({**record(made), "served_batch": 3}))
    served = tmp_path / "served.png"
    Image.open(made).save(served, pnginfo=meta)
    res = CliRunner().invoke(main, ["--replay", str(served), "--out", str(tmp_path / "b.png"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "served in a batch of 3 images; the replay runs it alone" in res.output
    res = CliRunner().invoke(main, ["--replay", str(made), "--out", str(tmp_path / "c.png"), "--quiet"])
    assert res.exit_code == 0 and "warning" not in res.output


def test_never_overwrites_silently(tmp_path):
    out = tmp_path / "x.png"
    assert _run("--prompt", "a", "--out", str(out)).exit_code == 0
    res = CliRunner().invoke(main, [*BASE, "--prompt", "a", "--out", str(out)])
    assert res.exit_code != 0 and "already exists; pass --overwrite" in res.output
    assert _run("--prompt", "a", "--out", str(out), "--overwrite").exit_code == 0


def test_errors_are_one_line(tmp_path):
    cases = [
        (["--prompt", "a", "--height", "30"], "height 30 is not divisible by 16"),
        (
            ["--prompt", "a", "--model", "nobody/nothing", "--offline"],
            "'nobody/nothing' is not in the local Hugging Face cache",
        ),
        (["--prompt", "a", "--model", str(tmp_path / "missing.safetensors")], "neither an existing file"),
        ([], "--prompt is required"),
        (["--prompt", "a", "--vae-tile", "6"], "vae_tile 6 must be None or a positive multiple of 4"),
        (["--prompt", "a", "--out", str(tmp_path / "x.jpg")], "images are written as PNG"),
    ]
    for args, message in cases:
        res = CliRunner().invoke(
            main, [*BASE, *args, "--out", str(tmp_path / "e.png")] if "--out" not in args else [*BASE, *args]
        )
        assert res.exit_code != 0, args
        assert message in res.output, (args, res.output)
        assert "Traceback" not in res.output


def test_replay_needs_a_flux_png(tmp_path):
    plain = tmp_path / "plain.png"
    Image.new("RGB", (8, 8)).save(plain)
    res = CliRunner().invoke(main, ["--replay", str(plain)])
    assert res.exit_code != 0 and "carries no flux-runtime provenance" in res.output


def _timings_line(tmp_path):
    """The --timings line of a two-line --prompts run."""
    lines = tmp_path / "p.txt"
    lines.write_text("a red fox\na blue bird\n")
    res = CliRunner().invoke(
        main, [*BASE, "--prompts", str(lines), "--out", str(tmp_path), "--timings"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    return next(x for x in res.output.splitlines() if "timings:" in x)


def test_timings_name_each_stage_and_the_peaks(tmp_path):
    """--timings: one line with the stages a user waits through, each image on its own, and the peaks."""
    import re

    line = _timings_line(tmp_path)
    stages = dict(re.findall(r"([a-z0-9 -]+?) ([0-9]+\.[0-9]+) s", line.split("timings: ")[1]))
    assert {"imports", "load", "image 1", "image 2", "save", "total"} <= {k.strip(" ,") for k in stages}
    assert "peak host RSS" in line
    assert "timings:" not in _run("--prompt", "a fox", "--out", str(tmp_path / "one.png")).output


def test_timings_split_each_call_into_its_stages(tmp_path):
    """--timings also splits the calls: encode, prepare, first step, other steps and decode, summed over the
    calls, lie within the calls' own laps."""
    import re

    line = _timings_line(tmp_path)
    laps = {k.strip(" ,"): float(v) for k, v in re.findall(r"([a-z0-9 -]+?) ([0-9]+\.[0-9]+) s", line)}
    parts = ["encode", "prepare", "first step", "other steps", "decode"]
    assert set(parts) <= set(laps), laps
    assert all(laps[p] >= 0 for p in parts) and laps["other steps"] > 0
    # the laps are printed to 0.01 s each
    assert sum(laps[p] for p in parts) <= laps["image 1"] + laps["image 2"] + 0.05, laps


def test_cuda_graphs_only_when_the_process_makes_several_calls(tmp_path, monkeypatch):
    """One call runs eagerly (capturing costs more than it saves over one image); --prompts replays graphs;
    one call with a step cache replays them too (its per-step decision stalls an eager GPU); --cuda-graphs and
    --no-cuda-graphs decide alone."""
    from flux_runtime.pipeline import Pipeline

    asked = []

    def ask(path_or_id, **kw):
        asked.append(kw["cuda_graphs"])
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(Pipeline, "from_pretrained", ask)
    lines = tmp_path / "p.txt"
    lines.write_text("a red fox\na blue bird\n")
    _run("--prompt", "a fox", "--out", str(tmp_path / "one.png"))
    _run("--prompts", str(lines), "--out", str(tmp_path))
    _run("--prompts", str(lines), "--out", str(tmp_path), "--no-cuda-graphs")
    _run("--prompt", "a fox", "--out", str(tmp_path / "one.png"), "--cuda-graphs")  # asked for: one call too
    _run("--prompt", "a fox", "--out", str(tmp_path / "one.png"), "--cache", "first-block")  # a cached call
    _run("--prompt", "a fox", "--out", str(tmp_path / "one.png"), "--cache", "off")
    _run("--prompt", "a fox", "--out", str(tmp_path / "one.png"), "--cache", "taylor", "--no-cuda-graphs")
    assert asked == [False, True, False, True, True, False, False]
