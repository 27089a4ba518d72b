"""`flux-serve` over HTTP on the trained tiny FLUX.2 model: edits from one or several reference images (as
multipart `image` parts, and as the openai client's `image[]` list) give the same bits as the same
`Flux2Pipe` call, and the FLUX.1-only fields are refused by name.

One server process for the module; every image is 64x64 or 80x64 with 2 steps.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.serve.images import decoded as _decoded
from tests.serve.images import png_with_info
from tests.serve.images import random_png as _png_bytes
from tests.serve.images import same_bits as _same_bits
from tests.serve.server import Server

EDITS = "/v1/images/edits"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--model", "tiny-flux2", "--max-n", "2", store=tmp_path_factory.mktemp("store"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny-flux2", device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("sizes", [[(64, 64)], [(64, 64), (80, 64)]], ids=["one", "two"])
def test_reference_edit_is_the_pipelines_image(server, pipe, sizes):
    uploads = [_png_bytes(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    files = [("image", (f"ref{i}.png", data, "image/png")) for i, data in enumerate(uploads)]
    form = {"prompt": "a red circle", "seed": "5", "steps": "2", "guidance": "3.0"}
    r = httpx.post(server.url + EDITS, files=files, data=form, timeout=120)
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    image, info = png_with_info(item["b64_json"])
    refs = [_decoded(d) for d in uploads]
    direct = pipe("a red circle", image=refs, seed=5, num_steps=2, guidance=3.0)
    _same_bits(image, direct.images[0])
    # the pipeline's default size: the first reference's; the provenance names every reference by hash
    assert image.size == sizes[0]
    hashes = [ref["sha256"] for ref in info["reference_images"]]
    assert len(hashes) == len(sizes) and hashes == [ref["sha256"] for ref in direct.info["reference_images"]]
    assert (info["model"], info["seed"], info["num_steps"], info["guidance"]) == ("tiny-flux2", 5, 2, 3.0)


def test_openai_client_sends_a_list_of_references(server, pipe):
    uploads = [_png_bytes(64, 64, 7), _png_bytes(64, 80, 8)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.images.edit(
        image=[(f"r{i}.png", d, "image/png") for i, d in enumerate(uploads)], prompt="a blue square",
        model="tiny-flux2", size="64x80", n=2, response_format="b64_json", extra_body={"seed": 3, "steps": 2},
    )  # fmt: skip
    refs = [_decoded(d) for d in uploads]
    for i, item in enumerate(out.data):  # image i is seed 3 + i, each one single pipeline call
        image, info = png_with_info(item.b64_json)
        direct = pipe("a blue square", image=refs, seed=3 + i, num_steps=2, width=64, height=80)
        _same_bits(image, direct.images[0])
        assert info["seed"] == 3 + i and len(info["reference_images"]) == 2


def test_text_to_image_is_the_pipelines_image(server, pipe):
    r = httpx.post(
        server.url + "/v1/images/generations",
        json={"prompt": "a green triangle", "seed": 2, "size": "64x64", "steps": 2}, timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    image, _ = png_with_info(r.json()["data"][0]["b64_json"])
    _same_bits(image, pipe("a green triangle", seed=2, width=64, height=64, num_steps=2).images[0])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"data": {"strength": "0.5"}}, "strength"),
        ({"data": {"max_area": "4096"}}, "max_area"),
        ({"files": [("mask", ("m.png", _png_bytes(64, 64, 1), "image/png"))]}, "mask"),
        ({"data": {"negative_prompt": "blurry"}}, "negative_prompt"),
        ({"data": {"upsample": "true"}}, "upsample"),
    ],
)
def test_flux1_only_fields_are_refused_by_name(server, extra, param):
    files = [("image", ("r.png", _png_bytes(64, 64, 0), "image/png")), *extra.get("files", [])]
    data = {"prompt": "x", "steps": "1", **extra.get("data", {})}
    r = httpx.post(server.url + EDITS, files=files, data=data, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_reference_the_pipeline_refuses_is_a_400_and_the_server_goes_on(server):
    files = [("image", ("tiny.png", _png_bytes(32, 32, 0), "image/png"))]  # under 64 px a side
    r = httpx.post(server.url + EDITS, files=files, data={"prompt": "x", "steps": "1"}, timeout=60)
    assert r.status_code == 400 and "64" in r.json()["error"]["message"], r.text
    files = [("image", ("ok.png", _png_bytes(64, 64, 0), "image/png"))]
    r = httpx.post(server.url + EDITS, files=files, data={"prompt": "x", "steps": "1"}, timeout=60)
    assert r.status_code == 200, r.text
