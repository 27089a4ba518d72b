"""What the model tests share: diffusers' transformer call, a tiny transformer in either layout, the tiny VAE
checkpoints and their references, the parity check of an encode and decode, the layout-table check of a
full-size model, and a run with diffusers made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from flux_runtime.weights import vae_layout
from tests.weights.vae_fixtures import make_image, save_diffusers_vae

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]


def diffusers_forward(
    model: Any, img, img_ids, txt, txt_ids, timesteps, guidance, **extra: Any
) -> torch.Tensor:
    """A diffusers FLUX.1 / FLUX.2 transformer's output (`extra`: FLUX.1's `pooled_projections`)."""
    with torch.no_grad():
        return model(
            hidden_states=img,
            encoder_hidden_states=txt,
            timestep=timesteps,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance if model.config.guidance_embeds else None,
            return_dict=False,
            **extra,
        )[0]


def save_as(layout: str, model: Any, tmp_path: Path, fixtures: Any) -> Path:
    """A diffusers transformer written as a diffusers folder or (`layout` "bfl") a BFL single file, by the
    family's `fixtures` module."""
    if layout == "diffusers":
        return fixtures.save_diffusers(model, tmp_path / "transformer")
    return fixtures.save_bfl(model, tmp_path / "transformer.safetensors")


def vae_fixtures(
    name: str, make_model: Callable[[], Any], save_bfl: Callable[[Any, Path], Path], diffusers_class: str
) -> tuple[Any, Any]:
    """The module fixtures `checkpoints` (the same tiny VAE from `make_model` as a diffusers folder and as a BFL
    single file) and `reference` (diffusers' `diffusers_class` loaded from the folder, per dtype in `DTYPES`)."""

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        root = tmp_path_factory.mktemp(name)
        model = make_model()
        return {
            "diffusers": save_diffusers_vae(model, root / "vae"),
            "bfl": save_bfl(model, root / "ae.safetensors"),
        }

    @pytest.fixture(scope="module")
    def reference(checkpoints: dict[str, Path]) -> dict[torch.dtype, Any]:
        import diffusers

        cls = getattr(diffusers, diffusers_class)
        # as a pipeline with torch_dtype loads it
        return {d: cls.from_pretrained(checkpoints["diffusers"], torch_dtype=d).eval() for d in DTYPES}

    return checkpoints, reference


@torch.no_grad()
def check_encode_decode(ours: Any, ref: Any, z_channels: int, dtype: torch.dtype) -> None:
    """Encode (mode and a seeded sample) and decode of a non-square batch of 2 equal diffusers' bit for bit."""
    x = make_image(2, 24, 40, dtype)

    z = ours.encode(x)
    assert z.shape == (2, z_channels, 12, 20) and z.dtype == dtype
    assert torch.equal(z, ref.encode(x).latent_dist.mode())

    g_ours, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    sampled = ours.encode(x, sample=True, generator=g_ours)
    assert torch.equal(sampled, ref.encode(x).latent_dist.sample(g_ref))
    assert not torch.equal(sampled, z)

    image = ours.decode(z)
    assert image.shape == (2, 3, 24, 40) and image.dtype == dtype
    assert torch.equal(image, ref.decode(z).sample)


def check_layout_table(
    layout: Any, rules: Iterable[Any], ours: torch.nn.Module, ref: torch.nn.Module
) -> None:
    """The `layout` module's `rules` map every diffusers tensor of `ref` onto `ours` (both on meta) with its shape."""
    table = list(rules)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert {r.bfl for r in table} == set(ours_shapes)
    assert {d for r in table for d in r.diffusers} == set(ref_shapes)
    for r in table:
        parts = layout.bfl_to_diffusers(r, torch.empty(ours_shapes[r.bfl], device="meta"))
        assert {k: tuple(v.shape) for k, v in parts.items()} == {d: ref_shapes[d] for d in r.diffusers}


def check_vae_layout_table(
    rules: Iterable[Any], ours: torch.nn.Module, ref: torch.nn.Module, optional: Iterable[str] = ()
) -> None:
    """The VAE layout `rules` map `ours` onto `ref` (both on meta) one to one, shapes included; `optional`: the
    diffusers keys the table leaves out."""
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    table = list(rules)
    assert sorted(r.bfl for r in table) == sorted(ours_sd)
    assert sorted(r.diffusers for r in table) == sorted(set(ref_sd) - set(optional))
    for r in table:
        assert vae_layout.diffusers_shape(r, tuple(ours_sd[r.bfl].shape)) == tuple(
            ref_sd[r.diffusers].shape
        ), r


def run_without_diffusers(body: str) -> None:
    """Run `body` (Python, `torch` and `flux_runtime` imported) in a fresh process where `import diffusers` fails;
    it must reach its end."""
    code = (
        "import sys\n"
        'sys.modules["diffusers"] = None  # any `import diffusers` now raises ImportError\n'
        "import torch, flux_runtime\n" + textwrap.dedent(body) + '\nprint("ok")\n'
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
