"""flux-convert on FLUX.2: transformer and VAE, both directions, bit-identical round trips, diffusers
loads what we write (and gets the same outputs), and the config.json we write is diffusers' own."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime import load_transformer, load_vae
from flux_runtime.models.dit import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B
from flux_runtime.models.vae import FLUX2_VAE
from flux_runtime.weights.diffusers_config import transformer_diffusers_config, vae_diffusers_config
from tests.cli.convert_helpers import assert_identical as _assert_identical
from tests.cli.convert_helpers import config as _config
from tests.cli.convert_helpers import fail as _fail
from tests.cli.convert_helpers import run as _run
from tests.cli.convert_helpers import tensors as _tensors
from tests.flux2_fixtures import make_diffusers_flux2, make_inputs, save_bfl, save_diffusers
from tests.models.helpers import diffusers_forward
from tests.weights.vae_fixtures import (
    make_diffusers_flux2_vae,
    make_image,
    save_bfl_flux2_vae,
    save_diffusers_vae,
)


def _forward(model, inputs):
    img, img_ids, txt, txt_ids, timesteps, guidance = inputs
    return diffusers_forward(model, img, img_ids, txt, txt_ids, timesteps, guidance)


def test_full_presets_write_diffusers_own_configs():
    """The config.json written for a full FLUX.2 BFL file is the one diffusers' converter saves.

    `convert_flux2_to_diffusers.py` builds `AutoencoderKLFlux2()` and `Flux2Transformer2DModel(**config)`
    with its dev / klein-4b / klein-9b configs; built on meta here.
    """
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    klein = dict(guidance_embeds=False)
    cases = [
        (FLUX2_DEV, {}),
        (
            FLUX2_KLEIN_4B,
            dict(
                num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, **klein
            ),
        ),
        (
            FLUX2_KLEIN_9B,
            dict(
                num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288, **klein
            ),
        ),
    ]
    with torch.device("meta"):
        assert json.loads(AutoencoderKLFlux2().to_json_string()) == json.loads(
            json.dumps(vae_diffusers_config(FLUX2_VAE))
        )
        for preset, kw in cases:
            theirs = Flux2Transformer2DModel(**kw)
            ours = json.loads(json.dumps(transformer_diffusers_config(preset)))
            assert json.loads(theirs.to_json_string()) == ours, preset


def test_transformer_diffusers_to_bfl_to_diffusers(tmp_path):
    """[dev]: diffusers → BFL is our table's file; back, sharded, is the source bit for bit and diffusers loads it."""
    from diffusers import Flux2Transformer2DModel

    model = make_diffusers_flux2(True)
    src = save_diffusers(model, tmp_path / "transformer")
    out = _run("transformer", src, tmp_path / "flux2-dev.safetensors")
    assert "transformer: diffusers -> bfl" in out
    _assert_identical(
        _tensors(tmp_path / "flux2-dev.safetensors"), _tensors(save_bfl(model, tmp_path / "ref.safetensors"))
    )

    back = tmp_path / "back"
    out = _run("transformer", tmp_path / "flux2-dev.safetensors", back, "--max-shard-size", "100KB")
    assert "transformer: bfl -> diffusers" in out
    assert len(list(back.glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    _assert_identical(_tensors(back), _tensors(src))
    assert _config(back) == _config(src)  # diffusers' own config.json for this model, field for field

    reloaded = Flux2Transformer2DModel.from_pretrained(back).eval()
    inputs = make_inputs(1, 2, 3, 4, torch.float32)
    assert torch.equal(_forward(reloaded, inputs), _forward(model, inputs))


def test_transformer_bfl_to_diffusers_to_bfl_keeps_dtype(tmp_path):
    """[klein], bf16, ComfyUI-prefixed: the config written is the one diffusers writes for the model."""
    from diffusers import Flux2Transformer2DModel

    model = make_diffusers_flux2(False).to(torch.bfloat16)
    src = save_bfl(model, tmp_path / "klein.safetensors", prefix="model.diffusion_model.")
    _run("transformer", src, tmp_path / "diffusers")
    assert _config(tmp_path / "diffusers") == _config(save_diffusers(model, tmp_path / "theirs"))
    reloaded = Flux2Transformer2DModel.from_pretrained(tmp_path / "diffusers", torch_dtype=torch.bfloat16)
    inputs = make_inputs(2, 2, 2, 3, torch.bfloat16)
    assert torch.equal(_forward(reloaded.eval(), inputs), _forward(model, inputs))
    ours = load_transformer(tmp_path / "diffusers", dtype=torch.bfloat16)
    assert ours.config.family == "flux2" and not ours.config.guidance_embed

    _run("transformer", tmp_path / "diffusers", tmp_path / "back.safetensors")
    original = {k.removeprefix("model.diffusion_model."): v for k, v in _tensors(src).items()}
    back = _tensors(tmp_path / "back.safetensors")
    _assert_identical(back, original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}


def test_transformer_config_bfl_cannot_express_is_refused(tmp_path):
    src = save_diffusers(make_diffusers_flux2(False), tmp_path / "transformer")
    cfg = _config(src)
    (src / "config.json").write_text(json.dumps({**cfg, "eps": 1e-5}))
    assert "BFL's FLUX.2 cannot express eps 1e-05 (BFL fixes 1e-06)" in _fail(
        "transformer", src, tmp_path / "o.safetensors"
    )
    assert not (tmp_path / "o.safetensors").exists()


def test_transformer_keys_are_checked(tmp_path):
    model = make_diffusers_flux2(True)
    src = save_bfl(model, tmp_path / "flux2.safetensors")
    sd = load_file(src)
    del sd["double_blocks.1.txt_attn.qkv.weight"]
    save_file(sd, tmp_path / "m.safetensors")
    assert "missing 1 key(s): double_blocks.1.txt_attn.qkv.weight" in _fail(
        "transformer", tmp_path / "m.safetensors", tmp_path / "o"
    )
    folder = save_diffusers(model, tmp_path / "t")
    sd = load_file(folder / "diffusion_pytorch_model.safetensors")
    sd["transformer_blocks.0.attn.to_k.weight"] = torch.zeros(64, 63)
    save_file(sd, folder / "diffusion_pytorch_model.safetensors")
    assert "transformer_blocks.0.attn.to_k.weight: expected shape (64, 64), checkpoint has (64, 63)" in _fail(
        "transformer", folder, tmp_path / "o.safetensors"
    )


@torch.no_grad()
def test_vae_diffusers_to_bfl_to_diffusers(tmp_path):
    """The BatchNorm counter diffusers writes travels to the BFL file and back; config.json is diffusers'."""
    from diffusers import AutoencoderKLFlux2

    model = make_diffusers_flux2_vae()
    src = save_diffusers_vae(model, tmp_path / "vae")
    out = _run("vae", src, tmp_path / "ae.safetensors")
    assert "vae: diffusers -> bfl" in out
    bfl = _tensors(tmp_path / "ae.safetensors")
    assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.bias", "bn.running_var"} <= bfl.keys()
    assert bfl["bn.num_batches_tracked"].dtype == torch.int64

    _run("vae", tmp_path / "ae.safetensors", tmp_path / "back")
    _assert_identical(_tensors(tmp_path / "back"), _tensors(src))
    assert _config(tmp_path / "back") == _config(src)

    reloaded = AutoencoderKLFlux2.from_pretrained(tmp_path / "back").eval()
    x = make_image(1, 16, 24, torch.float32)
    z = model.encode(x).latent_dist.mode()
    assert torch.equal(reloaded.encode(x).latent_dist.mode(), z)
    assert torch.equal(reloaded.decode(z).sample, model.decode(z).sample)
    # and our loader reads the BFL file as the same model, statistics included
    ours = load_vae(tmp_path / "ae.safetensors", dtype=torch.float32)
    assert torch.equal(ours.encode(x), z)
    assert torch.equal(ours.bn.running_mean, reloaded.bn.running_mean)


def test_vae_bfl_to_diffusers_to_bfl(tmp_path):
    """A BFL file without the counter stays without it both ways; diffusers still loads the folder."""
    from diffusers import AutoencoderKLFlux2

    model = make_diffusers_flux2_vae(seed=5)
    src = save_bfl_flux2_vae(model, tmp_path / "ae.safetensors", prefix="vae.")
    out = _run("vae", src, tmp_path / "vae", "--max-shard-size", "200KB")
    assert "vae: bfl -> diffusers" in out
    assert (tmp_path / "vae" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert "bn.num_batches_tracked" not in _tensors(tmp_path / "vae")
    assert _config(tmp_path / "vae") == _config(save_diffusers_vae(model, tmp_path / "theirs"))
    reloaded = AutoencoderKLFlux2.from_pretrained(tmp_path / "vae")
    theirs = model.state_dict()
    _assert_identical(reloaded.state_dict(), theirs)  # the counter: diffusers' own 0 on both sides

    _run("vae", tmp_path / "vae", tmp_path / "back.safetensors")
    original = {k.removeprefix("vae."): v for k, v in _tensors(src).items()}
    _assert_identical(_tensors(tmp_path / "back.safetensors"), original)


def test_vae_counter_in_bfl_source_is_carried(tmp_path):
    model = make_diffusers_flux2_vae()
    src = save_bfl_flux2_vae(model, tmp_path / "ae.safetensors", counter=True)
    _run("vae", src, tmp_path / "vae")
    assert torch.equal(_tensors(tmp_path / "vae")["bn.num_batches_tracked"], torch.tensor(0))
    _run("vae", tmp_path / "vae", tmp_path / "back.safetensors")
    _assert_identical(_tensors(tmp_path / "back.safetensors"), _tensors(src))


@pytest.mark.parametrize("component", ["vae", "transformer"])
def test_wrong_component_is_one_line(tmp_path, component):
    vae_file = save_bfl_flux2_vae(make_diffusers_flux2_vae(), tmp_path / "ae.safetensors")
    dit_file = save_bfl(make_diffusers_flux2(False), tmp_path / "flux2.safetensors")
    src = dit_file if component == "vae" else vae_file
    message = (
        "not a FLUX.1 VAE in BFL or diffusers form" if component == "vae" else "not a FLUX.1 transformer"
    )
    assert message in _fail(component, src, tmp_path / "o")
    assert not (tmp_path / "o").exists()
