"""Bad ControlNet input is one FluxError naming the problem and the fix, before any model runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline, controlnets
from flux_runtime.weights.controlnet import load_controlnet
from tests.controlnet_fixtures import make_diffusers_controlnet
from tests.random_models import save_diffusers

# the widths of the built-in `tiny` model
TINY = dict(attention_head_dim=48, num_attention_heads=4, axes_dims_rope=(8, 20, 20))


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    root = tmp_path_factory.mktemp("nets")
    kinds = ("instantx", "union", "xlabs")
    return {kind: save_diffusers(make_diffusers_controlnet(kind, **TINY), root / kind) for kind in kinds}


def no_model_runs(pipe, monkeypatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    for obj, name in ((pipe.text_encoder, "encode"), (pipe.transformer, "forward"), (pipe.vae, "encode")):
        monkeypatch.setattr(obj, name, boom)
    for net in pipe.controlnets:
        monkeypatch.setattr(net, "forward", boom)


IMAGE = Image.new("RGB", (32, 32), (120, 30, 200))


@pytest.mark.parametrize(
    ("kinds", "kwargs", "message"),
    [
        (["instantx"], {}, "give a control_image for each of the 1 ControlNet"),
        (["instantx"], dict(control_image=Image.new("RGB", (48, 32))), "control_image 1 is 48x32 but the image"),
        (["instantx"], dict(control_image=IMAGE, control_mode=1), "has no control modes; control_mode is for union"),
        (["union"], dict(control_image=IMAGE), "union ControlNet: give control_mode"),
        (["union"], dict(control_image=IMAGE, control_mode=3), "control_mode 3 is not one of ControlNet 1's 3 modes"),
        (["union"], dict(control_image=IMAGE, control_mode="sketch"), "unknown control_mode 'sketch'"),
        (["instantx"], dict(control_image=IMAGE, controlnet_conditioning_scale=-1), r"must be a number in \[0, 100\]"),
        (["instantx"], dict(control_image=IMAGE, control_guidance_start=0.5, control_guidance_end=0.5),
         "control_guidance_start 0.5 must be below control_guidance_end 0.5"),
        (["instantx", "instantx"], dict(control_image=[IMAGE]), "control_image has 1 entries for 2 ControlNet"),
        (["instantx"], dict(control_image="edges.png"), "control_image"),
        (["instantx"], dict(control_image=IMAGE, image=IMAGE, strength=1.5), r"strength 1.5 must be in \(0, 1\]"),
        ([], dict(controlnet_conditioning_scale=0.5), "controlnet_conditioning_scale needs a ControlNet"),
    ],
)  # fmt: skip
def test_call_inputs_are_checked_before_any_model_work(nets, kinds, kwargs, message, monkeypatch):
    models = [load_controlnet(nets[k], dtype=torch.float32) for k in kinds]
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, controlnet=models or None)
    no_model_runs(pipe, monkeypatch)
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "height": 32, "width": 32, **kwargs})


def test_load_checks(nets, tmp_path):
    with pytest.raises(FluxError, match=r"ControlNets are FLUX\.1 models; this checkpoint is flux2"):
        Pipeline.from_pretrained("tiny-flux2", device="cpu", controlnet=nets["instantx"])
    with pytest.raises(FluxError, match=r"controlnet: .*neither an existing file"):
        Pipeline.from_pretrained("tiny", device="cpu", controlnet=tmp_path / "nothing.safetensors")
    with pytest.raises(FluxError, match="cannot run together"):
        Pipeline.from_pretrained("tiny", device="cpu", controlnet=[nets["instantx"], nets["xlabs"]])


def test_a_controlnet_for_another_model_is_refused(tmp_path):
    other = save_diffusers(
        make_diffusers_controlnet("instantx", **TINY, joint_attention_dim=16), tmp_path / "other"
    )
    with pytest.raises(FluxError, match="has text width 16, but tiny's transformer has 32"):
        Pipeline.from_pretrained("tiny", device="cpu", controlnet=other)


def test_xlabs_needs_an_8x_autoencoder(nets):
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, controlnet=nets["xlabs"])
    vae_2x = SimpleNamespace(config=SimpleNamespace(spatial_factor=2))
    with pytest.raises(
        FluxError, match="XLabs ControlNets read the control image 8x down, but tiny's autoencoder"
    ):
        controlnets.check_nets(pipe.controlnets, pipe.transformer, vae_2x, "tiny")


def test_a_controlnet_id_is_fetched_on_first_use(nets, online, tmp_path):
    """`controlnet="org/name"` on a first run fetches the ControlNet's config and weights (not its README or
    sample images) from the Hub, then loads it; a second run fetches nothing."""
    from tests.hub_server import Repo

    folder = nets["instantx"]
    (tmp_path / "README.md").write_text("a ControlNet")
    files = {p.name: p for p in folder.iterdir()} | {
        "README.md": tmp_path / "README.md",
        "images/a.png": tmp_path / "README.md",
    }
    online.repos["someone/flux-canny"] = Repo(files)
    pipe = Pipeline.from_pretrained(
        "tiny", device="cpu", dtype=torch.float32, controlnet="someone/flux-canny"
    )
    assert sorted(online.fetched("someone/flux-canny")) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]
    out = pipe("a cat", height=32, width=32, num_steps=1, control_image=IMAGE)
    assert out.info["controlnets"][0]["kind"] == "instantx"
    online.log.clear()
    Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, controlnet="someone/flux-canny")
    assert [(r.method, r.kind) for r in online.log] == [("GET", "info")]


def test_the_memory_plan_counts_the_controlnets(nets):
    """A ControlNet's weights stay on the device in every plan, counted with the autoencoder's; its residuals
    are counted in the denoising step's activations."""
    from flux_runtime.pipeline.placement import footprint

    plain = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    with_net = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, controlnet=nets["union"])
    net_bytes = sum(p.numel() * 4 for p in with_net.controlnets[0].parameters())
    a, b = footprint(plain), footprint(with_net)
    assert (
        net_bytes <= b.vae - a.vae < net_bytes + 512 * 64
    )  # each tensor rounded up to the allocator's 512 B
    tokens = (plain.default_size // 16) ** 2
    assert b.act_denoise - a.act_denoise == 2 * 2 * tokens * 192 * 4  # two double blocks' residuals, twice
