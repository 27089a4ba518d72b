"""flux-gen --prompts on the built-in tiny model: one load, one PNG per line with the pixels and provenance of
the same options run alone, readable names, --overwrite, and bad lines refused before any weights are read."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from flux_runtime.cli.prompts_file import slug
from flux_runtime.pipeline import Pipeline
from tests.cli.gen_helpers import pixels, record

BASE = ["--model", "tiny", "--height", "32", "--width", "32", "--steps", "2", "--quiet"]
FILE = """# two plain prompts and two JSON lines; the JSON ones override the command line's options
a red fox

{"prompt": "a blue circle", "seed": 3, "width": 48, "steps": 1, "num_images": 2}
{"prompt": "a cat", "image": "in.png", "strength": 0.8, "guidance": 4.0}
  # an indented comment
a red fox
"""
NAMES = [
    "0002-a-red-fox.png",
    "0004-a-blue-circle-1.png",
    "0004-a-blue-circle-2.png",
    "0005-a-cat.png",
    "0007-a-red-fox.png",
]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The prompts file above, run once into `out/`; (its folder, the CliRunner result, model loads)."""
    root = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)).save(root / "in.png")
    (root / "p.txt").write_text(FILE, encoding="utf-8")
    loads = []
    load = Pipeline.from_pretrained.__func__  # type: ignore[attr-defined]

    def counted(cls, *args, **kwargs):
        loads.append(args)
        return load(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Pipeline, "from_pretrained", classmethod(counted))
        res = CliRunner().invoke(
            main,
            [*BASE, "--prompts", str(root / "p.txt"), "--out", str(root / "out")],
            catch_exceptions=False,
        )
    return root, res, len(loads)


def test_one_load_and_one_png_per_line_named_by_line_and_prompt(made):
    root, res, loads = made
    assert res.exit_code == 0, res.output
    assert loads == 1
    assert sorted(p.name for p in (root / "out").iterdir()) == NAMES
    assert res.output.split() == [str(root / "out" / name) for name in NAMES]


def test_each_line_equals_its_options_run_alone(made, tmp_path):
    root, _, _ = made
    alone = {
        "0002-a-red-fox.png": ["--prompt", "a red fox"],
        "0004-a-blue-circle-1.png": ["--prompt", "a blue circle", "--seed", "3", "--width", "48", "--steps",
                                     "1", "--num-images", "2"],
        "0005-a-cat.png": ["--prompt", "a cat", "--image", str(root / "in.png"), "--strength", "0.8",
                           "--guidance", "4.0"],
    }  # fmt: skip
    for name, args in alone.items():
        out = tmp_path / (name.removesuffix(".png") if "--num-images" in args else name)
        single = CliRunner().invoke(main, [*BASE, *args, "--out", str(out)], catch_exceptions=False)
        assert single.exit_code == 0, single.output
        first = out / "flux-3-0.png" if "--num-images" in args else out
        assert np.array_equal(pixels(root / "out" / name), pixels(first)), name
        made_record, alone_record = record(root / "out" / name), record(first)
        assert made_record == alone_record, name  # the same provenance, as a single run writes it
    assert np.array_equal(pixels(root / "out" / NAMES[0]), pixels(root / "out" / NAMES[-1]))
    assert pixels(root / "out" / NAMES[1]).shape == (32, 48, 3)


def test_each_png_records_its_line_and_replays_alone(made, tmp_path):
    root, _, _ = made
    second = record(root / "out" / "0004-a-blue-circle-2.png")
    assert (second["prompt"], second["seed"], second["num_steps"], second["width"]) == (
        "a blue circle",
        3,
        1,
        48,
    )
    assert (second["index"], second["num_images"]) == (1, 2)
    cat = record(root / "out" / "0005-a-cat.png")
    assert cat["input_images"]["image"]["path"] == str((root / "in.png").resolve())
    assert (cat["strength"], cat["guidance"]) == (0.8, 4.0)
    for name in ("0004-a-blue-circle-2.png", "0005-a-cat.png"):
        again = tmp_path / name
        res = CliRunner().invoke(
            main,
            ["--replay", str(root / "out" / name), "--out", str(again), "--quiet"],
            catch_exceptions=False,
        )
        assert res.exit_code == 0, res.output
        assert np.array_equal(pixels(root / "out" / name), pixels(again)), name


def test_out_defaults_to_the_current_folder_and_never_overwrites_silently(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a fox\n")
    args = [*BASE, "--steps", "1", "--prompts", "p.txt"]
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    assert (tmp_path / "0001-a-fox.png").is_file()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "0001-a-fox.png already exists; pass --overwrite" in res.output
    assert CliRunner().invoke(main, [*args, "--overwrite"], catch_exceptions=False).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0001-a-fox.png", "p.txt"]  # no partial file left


def test_slug_is_short_readable_ascii():
    assert slug("A red fox, in the SNOW!") == "a-red-fox-in-the-snow"
    assert slug("Ünïcode façade") == "unicode-facade"
    assert slug("狐") == ""
    assert (
        slug("one two three four five six seven eight nine ten") == "one-two-three-four-five-six-seven-eight"
    )
    assert slug("x" * 50) == "x" * 40


# (the file's third line, or the whole file where it starts with "FILE:"; the one line the error must hold)
BAD_LINES = [
    ('{"prompt": "a", "sed": 1}', "p.txt:3: unknown key 'sed'; did you mean 'seed'?"),
    ('{"prompt": "a", "num-images": 2}', "p.txt:3: unknown key 'num-images'; did you mean 'num_images'?"),
    ('{"prompt": "a", "model": "tiny"}', "p.txt:3: 'model' is set once for the whole file; give --model on"),
    ('{"prompt": "a", "colour": "red"}', "p.txt:3: unknown key 'colour'; the keys are prompt, seed, width"),
    ('{"prompt": "a", "seed": -1}', "p.txt:3: seed -1 must be an integer in 0..2**64-1"),
    ('{"prompt": "a", "seed": "3"}', 'p.txt:3: seed "3" must be an integer in 0..2**64-1'),
    ('{"prompt": "a", "steps": 0}', "p.txt:3: steps 0 must be an integer >= 1"),
    ('{"prompt": "a", "steps": 5000}', "p.txt:3: num_steps 5000 is more than 1000"),
    (
        '{"prompt": "a", "width": 40}',
        "p.txt:3: width 40 is not divisible by 16; give a multiple of 16, e.g. 32",
    ),
    ('{"prompt": "a", "guidance": NaN}', "p.txt:3: guidance NaN must be a finite number >= 0"),
    ('{"prompt": "a", "no_upsample": 1}', "p.txt:3: no_upsample 1 must be true or false"),
    ('{"prompt": ""}', 'p.txt:3: prompt "" must be a non-empty string'),
    ('{"seed": 1}', 'p.txt:3: no "prompt"; every line needs one'),
    ('{"prompt": "a", "seed": 1, "seed": 2}', "p.txt:3: key 'seed' is given twice; keep one"),
    (
        '{"prompt": "a", seed: 1}',
        "p.txt:3: not valid JSON (Expecting property name enclosed in double quotes",
    ),
    (
        '{"prompt": "a", "image": "gone.png", "strength": 0.5}',
        "gone.png does not exist; relative paths are read",
    ),
    ('{"prompt": "a", "strength": 0.5}', "p.txt:3: --strength needs --image (img2img or inpainting)"),
    ("FILE:# only\n\n   # comments\n", "p.txt holds no prompts (blank lines and lines starting with # are"),
    ("FILE:a fox\n\xff\n", "p.txt:2: not UTF-8 text (byte 1 of the line); save the file as UTF-8"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[m[:40] for _, m in BAD_LINES])
def test_a_bad_line_fails_before_the_weights_load(tmp_path, monkeypatch, line, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(Pipeline, "from_pretrained", no_load)
    path = tmp_path / "p.txt"
    if line.startswith("FILE:"):
        path.write_bytes(line.removeprefix("FILE:").encode("latin-1"))
    else:
        path.write_text(f"# a comment\na good line\n{line}\n", encoding="utf-8")
    res = CliRunner().invoke(main, [*BASE, "--prompts", str(path), "--out", str(tmp_path / "out")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_options_that_exclude_prompts_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(Pipeline, "from_pretrained", None)  # never reached
    path = tmp_path / "p.txt"
    path.write_text('a fox\n{"prompt": "a cat", "negative_prompt": "blurry"}\n')
    cases = [
        (["--prompt", "a fox"], "--prompt and --prompts exclude each other"),
        (["--replay", str(path)], "--replay and --prompts exclude each other"),
        (["--out", str(tmp_path / "x.png")], "with --prompts, --out is a folder"),
        (["--out", str(path)], "with --prompts, --out is a folder"),
        (["--model", "tiny-flux2"], "p.txt:2: --negative-prompt needs a FLUX.1 model; tiny-flux2 is FLUX.2"),
    ]
    for args, message in cases:
        res = CliRunner().invoke(main, [*BASE, "--prompts", str(path), *args])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1 and message in lines[0], (args, res.output)
