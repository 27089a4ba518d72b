"""`flux-serve` serving the FLUX.1 variants over HTTP: a Kontext checkpoint edits its reference image and a
Fill checkpoint inpaints under its mask, each giving the same bits as the same `Pipeline` call; the fields a
variant does not take are refused by name before any work.

The checkpoints are the tiny dev components saved by diffusers as FluxKontextPipeline / FluxFillPipeline
folders (their model_index.json names the variant), one server process each; images are 64x64 or 64x48 with
2 steps, Kontext's reference kept at its own size (`auto_resize` false) to stay small on the CPU.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.serve.images import decoded as _decoded
from tests.serve.images import first_rgb as _served
from tests.serve.images import random_png as _png
from tests.serve.server import Server

EDITS = "/v1/images/edits"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from diffusers import FluxKontextPipeline

    from tests.pipeline.test_flux1_pipeline import _save_pipeline
    from tests.pipeline.test_flux1_variants import _save_variant

    root = tmp_path_factory.mktemp("serve-variants")
    dev = _save_pipeline(root / "dev", True)
    FluxKontextPipeline.from_pretrained(dev).save_pretrained(root / "kontext")
    return {"kontext": root / "kontext", "fill": _save_variant(dev, root / "fill", "FluxFillPipeline", 144)}


def _serve(folder, tmp_path_factory):
    return Server("--model", str(folder), store=tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def kontext(folders, tmp_path_factory):
    srv = _serve(folders["kontext"], tmp_path_factory)
    yield srv, Pipeline.from_pretrained(folders["kontext"], device="cpu", dtype=torch.float32)
    srv.stop()


@pytest.fixture(scope="module")
def fill(folders, tmp_path_factory):
    srv = _serve(folders["fill"], tmp_path_factory)
    yield srv, Pipeline.from_pretrained(folders["fill"], device="cpu", dtype=torch.float32)
    srv.stop()


def _edit(server: Server, files: list, **fields: str) -> httpx.Response:
    return httpx.post(server.url + EDITS, files=files, data={"steps": "2", **fields}, timeout=120)


def test_kontext_edit_is_the_pipelines_image(kontext):
    server, pipe = kontext
    upload = _png(64, 64, 1)
    files = [("image", ("ref.png", upload, "image/png"))]
    image, info = _served(
        _edit(server, files, prompt="a cat", seed="4", size="64x64", max_area="4096", auto_resize="false")
    )
    direct = pipe("a cat", image=_decoded(upload), seed=4, num_steps=2, width=64, height=64, max_area=4096,
                  auto_resize=False)  # fmt: skip
    assert image.tobytes() == direct.images[0].tobytes()
    assert (
        info["variant"] == "kontext" and info["reference_size"] == [64, 64] and info["auto_resize"] is False
    )


def test_kontext_edit_keeps_the_images_aspect_by_default(kontext):
    server, pipe = kontext
    upload = _png(64, 48, 2)
    files = [("image", ("ref.png", upload, "image/png"))]
    image, _ = _served(_edit(server, files, prompt="a dog", seed="1", max_area=str(64 * 48), auto_resize="0"))
    direct = pipe("a dog", image=_decoded(upload), seed=1, num_steps=2, width=64, height=48,
                  max_area=64 * 48, auto_resize=False)  # fmt: skip
    assert image.size == (64, 48) and image.tobytes() == direct.images[0].tobytes()


@pytest.mark.parametrize(
    ("fields", "mask", "param"),
    [
        ({"strength": "0.5"}, False, "strength"),
        ({}, True, "mask"),
        ({"auto_resize": "maybe"}, False, "auto_resize"),
    ],
)
def test_kontext_refuses_what_it_does_not_take(kontext, fields, mask, param):
    server, _ = kontext
    files = [("image", ("ref.png", _png(64, 64, 1), "image/png"))]
    if mask:
        files.append(("mask", ("m.png", _png(64, 64, 2, "L"), "image/png")))
    r = _edit(server, files, prompt="a cat", **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_fill_inpainting_is_the_pipelines_image(fill):
    server, pipe = fill
    upload, mask = _png(64, 64, 3), _png(64, 64, 4, "L")
    files = [("image", ("in.png", upload, "image/png")), ("mask", ("m.png", mask, "image/png"))]
    image, info = _served(_edit(server, files, prompt="a hat", seed="6"))
    direct = pipe("a hat", image=_decoded(upload), mask_image=_decoded(mask), seed=6, num_steps=2,
                  width=64, height=64)  # fmt: skip
    assert image.tobytes() == direct.images[0].tobytes()
    assert info["variant"] == "fill" and set(info["input_images"]) == {"image", "mask_image"}


@pytest.mark.parametrize(("fields", "param"), [({}, "mask"), ({"max_area": "4096"}, "max_area")])
def test_fill_refuses_what_it_does_not_take(fill, fields, param):
    server, _ = fill
    files = [("image", ("in.png", _png(64, 64, 3), "image/png"))]
    if param != "mask":
        files.append(("mask", ("m.png", _png(64, 64, 4, "L"), "image/png")))
    r = _edit(server, files, prompt="a hat", **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
