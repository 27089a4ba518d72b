"""Bad inputs to flux-gen and flux-convert: each ends in exit 1 and one line naming the problem.

One table, one row per kind of fault (damaged files of every kind the loaders read, bad arguments, bad
output paths), all through the real command. The built-in tiny models' weights, saved as BFL files, stand
in for checkpoints.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from safetensors.torch import save_file

import flux_runtime.cli.gen as gen
from flux_runtime.cli.convert import main as convert_main
from flux_runtime.pipeline.provenance import provenance
from flux_runtime.weights import load_transformer, load_vae

TINY = ["--height", "32", "--width", "32", "--steps", "2", "--quiet"]


def _png_with_record(path: Path, text: str) -> str:
    meta = PngInfo()
    meta.add_text("flux_runtime", text)
    Image.new("RGB", (8, 8)).save(path, pnginfo=meta)
    return str(path)


def _raw_safetensors(path: Path, header: dict, data: bytes) -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """Paths of one broken file or folder per kind of fault, each beside a good VAE where it needs one."""
    root = tmp_path_factory.mktemp("bad")
    sd = {
        k: v.contiguous()
        for k, v in load_transformer("tiny-random", dtype=torch.float32).state_dict().items()
    }
    ae = {k: v.contiguous() for k, v in load_vae("tiny-random", dtype=torch.float32).state_dict().items()}
    files = root / "set"  # BFL file sets: each transformer file with ae.safetensors beside it
    files.mkdir()
    save_file(ae, files / "ae.safetensors")
    save_file(sd, files / "good.safetensors")
    save_file({**sd, "txt_in.weight": sd["txt_in.weight"].to(torch.int8)}, files / "int8.safetensors")
    nan = sd["final_layer.linear.weight"].clone()
    nan[0, 0] = float("nan")
    save_file({**sd, "final_layer.linear.weight": nan}, files / "nan.safetensors")
    save_file({**sd, "img_in.weight": sd["img_in.weight"][:, :63].contiguous()}, files / "img_in.safetensors")
    entry = {"dtype": "F32", "shape": [2]}
    _raw_safetensors(files / "no_offsets.safetensors", {"img_in.weight": entry}, b"\0" * 8)
    _raw_safetensors(files / "not_object.safetensors", {"img_in.weight": [1, 2]}, b"")
    out: dict[str, str] = {k.stem: str(k) for k in files.glob("*.safetensors")}

    def folder(name: str, config: object | None = None, index: object | None = None) -> str:
        f = root / name
        f.mkdir()
        save_file(ae, f / "ae.safetensors")
        if index is None:
            save_file(sd, f / "diffusion_pytorch_model.safetensors")
        else:
            (f / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
        if config is not None:
            (f / "config.json").write_text(json.dumps(config))
        return str(f)

    out["index_list"] = folder("index_list", index={"weight_map": ["a.safetensors"]})
    out["config_list"] = folder("config_list", config=[1, 2])
    out["config_str"] = folder("config_str", config={"axes_dims_rope": "8,12,12"})
    out["scheduler"] = folder("scheduler")
    (root / "scheduler" / "scheduler").mkdir()
    (root / "scheduler" / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": "3"}))
    te = root / "text_encoder"
    te.mkdir()
    (te / "config.json").write_text("{}")
    (te / "model.safetensors").write_bytes(b"this is not a model at all")
    out["text_encoder"] = str(te)
    notes = root / "notes.txt"
    notes.write_text("hello\n" * 10)
    out["notes"] = str(notes)
    Image.new("RGB", (64, 64)).save(root / "big.png")
    out["big_png"] = str(root / "big.png")
    replays = {
        "replay_json": "{not json",
        "replay_list": "[1, 2]",
        "replay_missing": json.dumps({"prompt": "a fox"}),
    }
    for name, text in replays.items():
        out[name] = _png_with_record(root / f"{name}.png", text)
    good = provenance(
        prompt="a fox", seed=0, height=32, width=32, steps=2, guidance=3.5, max_sequence_length=512,
        tier="lossless", cuda_graphs=False, model="tiny", weights="tiny-seed0", dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    out["replay_typed"] = _png_with_record(root / "replay_typed.png", json.dumps({**good, "height": "32"}))
    out["replay_good"] = _png_with_record(root / "replay_good.png", json.dumps(good))
    out["a_file"] = str(notes)
    wide = root / "i16.png"  # a 16-bit greyscale picture: PIL opens it as I;16
    Image.fromarray((torch.arange(16 * 16).reshape(16, 16) * 256).numpy().astype("uint16")).save(wide)
    out["i16_png"] = str(wide)
    return out


# (arguments, with {name} for a path from `bad`; the message the one line must hold)
CASES = [
    # damaged files, each read by the loader that names it
    (["--replay", "{replay_json}"], "provenance is not valid JSON"),
    (["--replay", "{replay_list}"], "provenance is not a JSON object"),
    (["--replay", "{replay_missing}"], "provenance lacks seed, height"),
    (["--replay", "{replay_typed}"], "provenance field 'height' must be an integer >= 1, got \"32\""),
    (["--model", "{no_offsets}", *TINY], "tensor 'img_in.weight' has data_offsets None"),
    (["--model", "{not_object}", *TINY], "header entry 'img_in.weight' is not an object"),
    (["--model", "{index_list}", *TINY], "not a valid safetensors index ('weight_map' must map"),
    (["--model", "{config_list}", *TINY], "config.json: expected a JSON object, found a list"),
    (["--model", "{config_str}", *TINY], "config.json: 'axes_dims_rope' must be a list of integers"),
    (["--model", "{scheduler}", *TINY], "scheduler_config.json: 'shift' must be a finite number"),
    (
        [
            "--model",
            "{good}",
            "--text-encoder",
            "{text_encoder}",
            "--text-encoder-2",
            "{text_encoder}",
            *TINY,
        ],
        "model.safetensors: not a safetensors file",
    ),
    (["--model", "{int8}", *TINY], "int8.safetensors: txt_in.weight is stored as I8"),
    (["--model", "{nan}", *TINY], "nan.safetensors: final_layer.linear.weight holds NaN or infinite values"),
    (["--model", "{img_in}", *TINY], "img_in.safetensors: the transformer's img_in has width 63"),
    (["--model", "{notes}", *TINY], "notes.txt: not a safetensors file"),
    # arguments
    (["--model", "tiny", "--prompt", "a \udcff fox", *TINY], "prompt is not valid UTF-8 text"),
    (["--model", "tiny-flux2", "--image", "{big_png}", *TINY], "could be decompression bomb"),
    (["--model", "{notes}", "--image", "{i16_png}", *TINY], "i16.png has I;16 pixels (more than 8 bits)"),
    (["--model", "tiny", "--guidance", "inf", *TINY], "guidance inf must be a finite number >= 0"),
    (["--model", "{notes}", "--guidance", "1e300", *TINY], "guidance 1e+300 is more than 1000"),
    (["--model", "tiny", "--true-cfg", "1e300", *TINY], "true_cfg_scale 1e+300 is more than 1000"),
    (["--model", "tiny", "--steps", "1000000000"], "num_steps 1000000000 is more than 1000"),
    (["--model", "tiny", "--vae-tile", "4"], "vae_tile 4 is below the minimum of 16 latent pixels"),
    # a size past the largest side fails before the (here damaged) model is read
    (["--model", "{notes}", *TINY, "--width", "16000"], "width 16000 is more than 8192 px"),
    (["--model", "tiny-random", "--vae-tile", "20", *TINY, "--width", "92"], "leaves a 1-pixel edge tile"),
    (["--model", "tiny", "--text-encoder", "{a_file}", *TINY], "tiny is a built-in model with its own text"),
    (["--model", "tiny", "--num-images", "1000000", *TINY], "x 1000000 image(s) in one call need at least"),
    (["--model", "tiny", "--device", "meta", *TINY], "device 'meta' is not one to run on: use 'cpu'"),
    (["--model", "tiny", "--device", "gpu", *TINY], "device 'gpu' is not one to run on"),
    (["--replay", "{replay_good}", "--prompt", "b", "--steps", "3"], "--replay takes --prompt, --steps"),
    # output paths, found before any weights are read
    (["--model", "tiny", "--out", "{a_file}/x.png"], "notes.txt is not a folder"),
    (
        ["--model", "tiny", "--out", "{notes}.d/deeper/x.png"],
        "does not exist; create it or choose another --out",
    ),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[m[:40] for _, m in CASES])
def test_bad_input_is_one_line_and_exit_1(bad, tmp_path, monkeypatch, args, message) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # makes big.png a decompression bomb
    argv = [a.format(**bad) for a in args]
    if "--prompt" not in argv and "--replay" not in argv:
        argv += ["--prompt", "a fox"]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "x.png")]
    res = CliRunner().invoke(gen.main, argv)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1, res.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert message in lines[0], lines[0]
    assert "Traceback" not in res.output
    assert not (tmp_path / "x.png").exists()


# (arguments, with {name} for a path from `bad`; the one line): faults found before any weights are read
EARLY = [
    (
        ["--model", "tiny", "--width", "100"],
        "width 100 is not divisible by 16; give a multiple of 16, e.g. 96 or 112",
    ),
    (
        ["--model", "tiny-random", "--width", "102"],
        "width 102 is not divisible by 4; give a multiple of 4, e.g. 100 or 104",
    ),
    (["--model", "tiny", "--lora", "{notes}"], "notes.txt: not a safetensors file (header length"),
    (["--model", "tiny", "--lora", "{tmp}/none.safetensors"], "--lora: '"),
    (
        ["--model", "tiny", "--cuda-graphs", "--no-cuda-graphs"],
        "--cuda-graphs and --no-cuda-graphs contradict",
    ),
    (["--model", "tiny", "--attention", "fa3-fp8"], "--attention fa3-fp8 needs --quality high"),
    (
        ["--model", "tiny", "--attention", "fa3-fp8", "--quality", "high"],
        "--attention fa3-fp8 cannot run here: on cpu; FP8 attention needs an sm90 (Hopper) GPU",
    ),
]


@pytest.mark.parametrize(("args", "message"), EARLY, ids=[m[:40] for _, m in EARLY])
def test_faults_found_before_the_weights_load(bad, tmp_path, monkeypatch, args, message):
    from flux_runtime.pipeline import Pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(Pipeline, "from_pretrained", no_load)
    argv = [a.format(**bad, tmp=tmp_path) for a in args] + [
        "--prompt",
        "a fox",
        "--out",
        str(tmp_path / "x.png"),
    ]
    res = CliRunner().invoke(gen.main, argv)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert message in lines[0], lines[0]


def test_convert_errors_are_one_line(bad, tmp_path) -> None:
    res = CliRunner().invoke(convert_main, ["transformer", bad["no_offsets"], str(tmp_path / "out")])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "has data_offsets None" in res.output


def test_an_unforeseen_error_is_one_line_asking_for_a_report(monkeypatch, tmp_path) -> None:
    def broken(opts):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(gen, "generate", broken)
    argv = ["--prompt", "a", "--out", str(tmp_path / "x.png")]
    res = CliRunner().invoke(gen.main, argv)
    assert res.exit_code == 1 and res.output.count("\n") == 1
    assert "internal error: TypeError: unsupported operand (please report this" in res.output
    debug = CliRunner().invoke(gen.main, [*argv, "--debug"])
    assert isinstance(debug.exception, TypeError)  # raised through: Python prints the traceback


def test_ctrl_c_is_one_line(monkeypatch, tmp_path) -> None:
    def interrupted(opts):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "generate", interrupted)
    res = CliRunner().invoke(gen.main, ["--prompt", "a", "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 130 and res.output.strip() == "Error: interrupted"


def test_the_command_imports_no_torch_before_its_error_handling_runs() -> None:
    # so a Ctrl-C while torch loads (inside main) is caught like any other interruption
    code = "import sys, flux_runtime.cli.gen; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    env_path = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": env_path},
    )
    assert out.stdout.strip() == "[]"
