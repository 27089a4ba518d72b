"""flux-convert: bit-identical round trips, output diffusers loads, sharding, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from flux_runtime import load_transformer, load_vae
from flux_runtime.cli.convert import main
from flux_runtime.weights.safetensors_writer import Output, parse_size, shard
from tests.cli.convert_helpers import assert_identical as _assert_identical
from tests.cli.convert_helpers import fail as _fail
from tests.cli.convert_helpers import run as _run
from tests.cli.convert_helpers import tensors as _tensors
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs, save_bfl, save_diffusers
from tests.models.helpers import diffusers_forward
from tests.weights.vae_fixtures import make_diffusers_vae, make_image, save_bfl_vae, save_diffusers_vae

REPO = Path(__file__).resolve().parents[2]


def _forward(model, inputs):
    img, img_ids, txt, txt_ids, timesteps, y, guidance = inputs
    return diffusers_forward(model, img, img_ids, txt, txt_ids, timesteps, guidance, pooled_projections=y)


def test_transformer_diffusers_to_bfl_to_diffusers(tmp_path):
    from diffusers import FluxTransformer2DModel

    model = make_diffusers_transformer(True)
    src = save_diffusers(model, tmp_path / "transformer")
    out = _run("transformer", src, tmp_path / "flux1.safetensors")
    assert "transformer: diffusers -> bfl" in out
    # the BFL file is exactly what the rule table makes, and our loader reads it
    _assert_identical(
        _tensors(tmp_path / "flux1.safetensors"), _tensors(save_bfl(model, tmp_path / "ref.safetensors"))
    )

    _run("transformer", tmp_path / "flux1.safetensors", tmp_path / "back")
    _assert_identical(_tensors(tmp_path / "back"), _tensors(src))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text()
    )

    reloaded = FluxTransformer2DModel.from_pretrained(tmp_path / "back").eval()
    inputs = make_inputs(1, 2, 3, 4, torch.float32)
    assert torch.equal(_forward(reloaded, inputs), _forward(model, inputs))


def test_transformer_bfl_to_diffusers_to_bfl_keeps_dtype(tmp_path):
    model = make_diffusers_transformer(False).to(torch.bfloat16)  # schnell, bf16 like the real file
    src = save_bfl(model, tmp_path / "schnell.safetensors", prefix="model.diffusion_model.")
    _run("transformer", src, tmp_path / "diffusers")
    cfg = json.loads((tmp_path / "diffusers" / "config.json").read_text())
    assert cfg["guidance_embeds"] is False and cfg["_class_name"] == "FluxTransformer2DModel"
    _run("transformer", tmp_path / "diffusers", tmp_path / "back.safetensors")
    original = {k.removeprefix("model.diffusion_model."): v for k, v in _tensors(src).items()}
    back = _tensors(tmp_path / "back.safetensors")
    _assert_identical(back, original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}


@torch.no_grad()
def test_vae_diffusers_to_bfl_to_diffusers(tmp_path):
    from diffusers import AutoencoderKL

    model = make_diffusers_vae()
    src = save_diffusers_vae(model, tmp_path / "vae")
    _run("vae", src, tmp_path / "ae.safetensors")
    _run("vae", tmp_path / "ae.safetensors", tmp_path / "back")
    _assert_identical(_tensors(tmp_path / "back"), _tensors(src))
    ours, theirs = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "back", src))
    # a BFL file has no sample_size (diffusers' default tile size): it takes FLUX.1's 1024
    assert ours.keys() == theirs.keys()
    assert {k for k in ours if ours[k] != theirs[k]} == {"sample_size"} and ours["sample_size"] == 1024

    reloaded = AutoencoderKL.from_pretrained(tmp_path / "back").eval()
    x = make_image(1, 16, 24, torch.float32)
    z = model.encode(x).latent_dist.mode()
    assert torch.equal(reloaded.encode(x).latent_dist.mode(), z)
    assert torch.equal(reloaded.decode(z).sample, model.decode(z).sample)
    # and our own loader reads the BFL file as the same model
    assert torch.equal(load_vae(tmp_path / "ae.safetensors", dtype=torch.float32).encode(x), z)


def test_vae_bfl_to_diffusers_to_bfl(tmp_path):
    src = save_bfl_vae(make_diffusers_vae(seed=5), tmp_path / "ae.safetensors")
    out = _run("vae", src, tmp_path / "vae")
    assert "vae: bfl -> diffusers" in out
    _run("vae", tmp_path / "vae", tmp_path / "back.safetensors")
    _assert_identical(_tensors(tmp_path / "back.safetensors"), _tensors(src))


def test_sharded_output_is_what_diffusers_and_we_read(tmp_path):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    model = make_diffusers_transformer(True)
    src = save_bfl(model, tmp_path / "flux1.safetensors")
    _run("transformer", src, tmp_path / "t", "--max-shard-size", "100KB")
    folder = tmp_path / "t"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) > 5 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    total = 0
    for s in shards:
        tensors = load_file(s)
        assert all(index["weight_map"][k] == s.name for k in tensors)
        size = sum(t.nbytes for t in tensors.values())
        assert size <= 100_000 or len(tensors) == 1, s.name  # only a tensor past the limit stands alone
        total += size
    assert index["metadata"]["total_size"] == total

    reloaded = FluxTransformer2DModel.from_pretrained(folder).eval()
    inputs = make_inputs(1, 2, 2, 3, torch.float32)
    assert torch.equal(_forward(reloaded, inputs), _forward(model, inputs))
    ours = load_transformer(folder, dtype=torch.float32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            ours.state_dict().values(),
            load_transformer(src, dtype=torch.float32).state_dict().values(),
            strict=True,
        )
    )

    vae = make_diffusers_vae()
    _run("vae", save_bfl_vae(vae, tmp_path / "ae.safetensors"), tmp_path / "v", "--max-shard-size", "200kB")
    assert (tmp_path / "v" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    _assert_identical(AutoencoderKL.from_pretrained(tmp_path / "v").state_dict(), vae.state_dict())


def test_existing_output_needs_overwrite(tmp_path):
    src = save_bfl_vae(make_diffusers_vae(), tmp_path / "ae.safetensors")
    dst = tmp_path / "vae"
    _run("vae", src, dst, "--max-shard-size", "200KB")
    assert len(list(dst.glob("*.safetensors"))) > 1
    assert "already exists and is not empty; pass overwrite (--overwrite)" in _fail("vae", src, dst)
    # overwriting with one shard leaves no stale shards or index behind
    (dst / "README.md").write_text("kept")
    _run("vae", src, dst, "--overwrite")
    assert sorted(p.name for p in dst.iterdir()) == [
        "README.md",
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]

    back = tmp_path / "back.safetensors"
    _run("vae", dst, back)
    assert "back.safetensors already exists; pass overwrite" in _fail("vae", dst, back)
    _run("vae", dst, back, "--overwrite", "-q")
    _assert_identical(_tensors(back), _tensors(src))


def test_errors_are_one_line(tmp_path):
    vae_file = save_bfl_vae(make_diffusers_vae(), tmp_path / "ae.safetensors")
    assert "neither an existing file or folder" in _fail(
        "vae", tmp_path / "missing.safetensors", tmp_path / "o"
    )
    assert "unknown checkpoint layout: not a FLUX.1 transformer" in _fail(
        "transformer", vae_file, tmp_path / "o"
    )
    assert "would overwrite the input" in _fail("vae", vae_file, vae_file, "--overwrite")
    folder = save_diffusers_vae(make_diffusers_vae(), tmp_path / "vae")
    assert "give a path ending in .safetensors" in _fail("vae", folder, tmp_path / "ae.bin")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    assert "the file is empty" in _fail("vae", tmp_path / "empty.safetensors", tmp_path / "o")
    result = CliRunner().invoke(main, ["vae", str(vae_file), str(tmp_path / "o"), "--max-shard-size", "ten"])
    assert result.exit_code == 2 and "cannot read 'ten' as a size" in result.output
    assert not (tmp_path / "o").exists()


def test_partial_output_is_removed_on_failure(tmp_path, monkeypatch):
    from flux_runtime.weights import convert

    src = save_bfl_vae(make_diffusers_vae(), tmp_path / "ae.safetensors")
    calls = []

    def flaky(rule, t):
        if t.device.type != "meta":  # planning runs the rules on meta tensors; fail while writing
            calls.append(rule)
            if len(calls) == 40:
                raise OSError("disk full")
        return original(rule, t)

    original = convert.vae_layout.bfl_to_diffusers
    monkeypatch.setattr(convert.vae_layout, "bfl_to_diffusers", flaky)
    assert "disk full" in _fail("vae", src, tmp_path / "vae")
    assert len(calls) == 40 and not (tmp_path / "vae").exists()


def test_size_parsing_and_sharding_rules():
    assert parse_size("10GB") == 10**9 * 10 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500kb") == 500_000 and parse_size("1.5MB") == 1_500_000 and parse_size(7) == 7
    with pytest.raises(ValueError, match="cannot read '10 parsecs' as a size"):
        parse_size("10 parsecs")
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0GB")
    outs = [Output(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    # bytes 40, 40, 120, 20, 20, 20: packed in order up to 100; the 120-byte tensor stands alone
    groups = shard(outs, 100)
    assert [[o.key for o in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_script_is_the_same_command(tmp_path):
    model = make_diffusers_vae()
    src = save_bfl_vae(model, tmp_path / "ae.safetensors")
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "convert_weights.py"),
            "vae",
            str(src),
            str(tmp_path / "vae"),
        ],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert "vae: bfl -> diffusers" in res.stdout
    _assert_identical(_tensors(tmp_path / "vae"), model.state_dict())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tiny", "tiny is a built-in model, not a checkpoint; its files (BFL layout) are in "),
        (
            "tiny-random",
            "tiny-random is a built-in model of seeded random weights; it has no files to convert",
        ),
    ],
)
def test_a_builtin_name_is_no_checkpoint_to_convert(tmp_path, name, message):
    res = CliRunner().invoke(main, ["transformer", name, str(tmp_path / "out")])
    assert res.exit_code == 1 and res.output.startswith(f"Error: {message}"), res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
