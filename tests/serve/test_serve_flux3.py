"""`flux-serve` over HTTP on the built-in tiny FLUX.3 model: text to image (a request's n images as one call with
one seed each) and edits from one or several reference images give the same bits as the same `Flux3Pipe` call;
the fields FLUX.3 does not take are refused by name.

One server process for the module; every image is 64x64 with 2 steps.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.serve.images import decoded as _decoded
from tests.serve.images import random_png as _png_bytes
from tests.serve.images import same_bits as _same_bits
from tests.serve.images import served as _answers
from tests.serve.server import Server

EDITS = "/v1/images/edits"
MODEL = "tiny-flux3-random"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--model", MODEL, "--max-n", "2", store=tmp_path_factory.mktemp("store"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained(MODEL, device="cpu", dtype=torch.float32)


def test_text_to_image_n_images_are_one_call_with_a_seed_each(server, pipe):
    r = httpx.post(
        server.url + "/v1/images/generations",
        json={"prompt": "a green triangle", "seed": 2, "size": "64x64", "steps": 2, "n": 2}, timeout=120,
    )  # fmt: skip
    served = _answers(r)
    gens = [torch.Generator("cpu").manual_seed(s) for s in (2, 3)]
    direct = pipe(
        "a green triangle", generator=gens, num_images_per_prompt=2, width=64, height=64, num_steps=2
    )
    assert len(served) == 2
    for (image, info), want, seed in zip(served, direct.images, (2, 3), strict=True):
        _same_bits(image, want)
        assert (info["model"], info["seed"], info["num_steps"]) == (MODEL, seed, 2)


@pytest.mark.parametrize("sizes", [[(64, 64)], [(64, 64), (80, 64)]], ids=["one", "two"])
def test_reference_edit_is_the_pipelines_image(server, pipe, sizes):
    uploads = [_png_bytes(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    files = [("image", (f"ref{i}.png", data, "image/png")) for i, data in enumerate(uploads)]
    form = {"prompt": "a red circle", "seed": "5", "steps": "2"}
    ((image, info),) = _answers(httpx.post(server.url + EDITS, files=files, data=form, timeout=120))
    refs = [_decoded(d) for d in uploads]
    direct = pipe("a red circle", image=refs, generator=[torch.Generator().manual_seed(5)], num_steps=2)
    _same_bits(image, direct.images[0])
    assert len(info["reference_images"]) == len(sizes)
    assert [r["sha256"] for r in info["reference_images"]] == [
        r["sha256"] for r in direct.info["reference_images"]
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"data": {"strength": "0.5"}}, "strength"),
        ({"data": {"max_area": "4096"}}, "max_area"),
        ({"files": [("mask", ("m.png", _png_bytes(64, 64, 1), "image/png"))]}, "mask"),
        ({"data": {"negative_prompt": "blurry"}}, "negative_prompt"),
        ({"data": {"true_cfg_scale": "2"}}, "true_cfg_scale"),
        (
            {"files": [("image", (f"{i}.png", _png_bytes(64, 64, i), "image/png")) for i in range(10)]},
            "image",
        ),
    ],
)
def test_fields_flux3_does_not_take_are_refused_by_name(server, extra, param):
    files = [("image", ("r.png", _png_bytes(64, 64, 0), "image/png")), *extra.get("files", [])]
    data = {"prompt": "x", "steps": "1", **extra.get("data", {})}
    r = httpx.post(server.url + EDITS, files=files, data=data, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "FLUX.3" in r.json()["error"]["message"]


def test_upsample_is_the_pipelines_switch(server):
    body = {"prompt": "a red fox", "seed": 1, "size": "64x64", "steps": 1}
    ((_, info),) = _answers(httpx.post(server.url + "/v1/images/generations", json=body, timeout=120))
    assert info["upsample"] == "unavailable"  # the built-in tiny FLUX.3 has no upsampler
    off = httpx.post(server.url + "/v1/images/generations", json={**body, "upsample": False}, timeout=120)
    assert _answers(off)[0][1]["upsample"] == "off"
    on = httpx.post(server.url + "/v1/images/generations", json={**body, "upsample": True}, timeout=120)
    assert on.status_code == 400 and "has no prompt upsampler" in on.json()["error"]["message"], on.text
