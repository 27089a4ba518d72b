"""`flux-serve` over HTTP on the trained tiny model: generations, edits, errors, models, metrics, a load test.

One server process for the module (batching on); every request is 64x64 with 1-2 steps.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import statistics
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from flux_runtime.pipeline import Pipeline
from tests.serve.images import decoded as _decoded
from tests.serve.images import png_with_info as _png
from tests.serve.server import Server

GEN = "/v1/images/generations"
SMALL = {"size": "64x64", "steps": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--model", "tiny", "--max-batch", "4", "--max-n", "3", "--max-upload-mb", "0.05",
                 "--store-max", "3", store=tmp_path_factory.mktemp("store"))  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)


def _post(server: Server, body: dict, path: str = GEN) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_generation_is_the_pipelines_image_with_its_provenance(server, pipe):
    r = _post(server, {"prompt": "a red circle", "seed": 7, **SMALL})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    image, info = _png(item["b64_json"])
    assert image.size == (64, 64)
    assert (info["prompt"], info["seed"], info["num_steps"], info["model"]) == ("a red circle", 7, 2, "tiny")
    direct = pipe("a red circle", seed=7, width=64, height=64, num_steps=2).images[0]
    assert image.convert("RGB").tobytes() == direct.tobytes()


def test_a_step_cached_generation_is_the_pipelines_and_records_its_policy(server, pipe):
    r = _post(server, {"prompt": "a red circle", "seed": 3, "cache": "first-block:threshold=0.5", "size": "64x64",
                       "steps": 6})  # fmt: skip
    assert r.status_code == 200, r.text
    image, info = _png(r.json()["data"][0]["b64_json"])
    assert info["cache"]["spec"] == "first-block:warmup=1,last=1,probe=1,threshold=0.5"
    direct = pipe("a red circle", seed=3, width=64, height=64, num_steps=6, cache="first-block:threshold=0.5")
    assert info["cache"] == direct.info["cache"]
    assert image.convert("RGB").tobytes() == direct.images[0].tobytes()


def test_n_images_are_seed_plus_i_and_url_format_serves_them(server):
    r = _post(server, {"prompt": "a blue square", "n": 2, "seed": 11, "response_format": "url", **SMALL})
    assert r.status_code == 200, r.text
    urls = [d["url"] for d in r.json()["data"]]
    seeds = []
    for url in urls:
        got = httpx.get(url, timeout=10)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        seeds.append(json.loads(Image.open(io.BytesIO(got.content)).text["flux_runtime"])["seed"])
    assert seeds == [11, 12]
    assert httpx.get(server.url + "/v1/images/files/" + "0" * 32 + ".png").status_code == 404


def test_url_store_is_bounded(server):
    urls = [_post(server, {"prompt": f"p{i}", "seed": i, "response_format": "url", **SMALL}).json()["data"][0]["url"]
            for i in range(4)]  # fmt: skip
    codes = [httpx.get(u, timeout=10).status_code for u in urls]
    assert codes == [404, 200, 200, 200]  # --store-max 3: the oldest is gone


def test_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    out = client.images.generate(
        model="tiny", prompt="a green triangle", size="64x64", response_format="b64_json",
        extra_body={"seed": 3, "steps": 1},
    )  # fmt: skip
    _, info = _png(out.data[0].b64_json)
    assert (info["seed"], info["num_steps"]) == (3, 1)
    with pytest.raises(openai.NotFoundError) as e:
        client.images.generate(model="flux1-dev", prompt="x", size="64x64")
    assert e.value.body["param"] == "model"


def _image_bytes(color: str, size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def test_img2img_and_inpainting_are_the_pipelines_images(server, pipe):
    upload = _image_bytes("red")
    files = {"image": ("in.png", upload, "image/png")}
    r = httpx.post(server.url + "/v1/images/edits", files=files, data={"prompt": "a cat", "steps": "2", "seed": "1", "strength": "0.5"}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    image, info = _png(r.json()["data"][0]["b64_json"])
    assert image.size == (64, 64) and info["strength"] == 0.5 and "image" in info["input_images"]
    # the size an edit defaults to is its image's (the pipeline's own default is the model's size)
    direct = pipe(
        "a cat", image=_decoded(upload), strength=0.5, seed=1, num_steps=2, width=64, height=64
    ).images[0]
    assert image.convert("RGB").tobytes() == direct.tobytes()
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    buf = io.BytesIO()
    mask.save(buf, format="PNG")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.images.edit(
        image=("in.png", upload, "image/png"), mask=("m.png", buf.getvalue(), "image/png"),
        prompt="a cat", response_format="b64_json", extra_body={"steps": 2, "seed": 1},
    )  # fmt: skip
    image, info = _png(out.data[0].b64_json)
    assert set(info["input_images"]) == {"image", "mask_image"}
    direct = pipe("a cat", image=_decoded(upload), mask_image=_decoded(buf.getvalue()), seed=1, num_steps=2,
                  width=64, height=64)  # fmt: skip
    assert image.convert("RGB").tobytes() == direct.images[0].tobytes()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "size": "65x64"}, 400, "size"),
        ({"prompt": "x", "size": "big"}, 400, "size"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "n": 4}, 400, "n"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": "word " * 200}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "steps": 0}, 400, "steps"),
        ({"prompt": "x", "quality": "hd"}, 400, "quality"),
        ({"prompt": "x", "cache": "teacache"}, 400, "cache"),
        ({"prompt": "x", "cache": "first-block:threshold=2"}, 400, "cache"),
        ({"prompt": "x", "colour": "red"}, 400, "colour"),
    ],
)
def test_bad_generations_name_the_field(server, body, status, param):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "x"', "the request body is not valid JSON (at character"),
        (b"[1, 2]", "the request body must be a JSON object"),
        (b'"a cat"', "the request body must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_says_so(server, content, message):
    r = httpx.post(
        server.url + GEN, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(message) and err["param"] is None, err


def test_a_well_formed_size_over_the_limit_is_told_the_limit(server):
    r = _post(server, {"prompt": "x", "size": "100000x64"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    assert "width 100000 is over this server's" in r.json()["error"]["message"]


def test_bad_uploads_name_the_field(server):
    url = server.url + "/v1/images/edits"
    r = httpx.post(
        url, files={"image": ("x.png", b"not a png", "image/png")}, data={"prompt": "x"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    big = _image_bytes("red", 16) + b"\0" * 60_000  # over --max-upload-mb 0.05
    r = httpx.post(url, files={"image": ("x.png", big, "image/png")}, data={"prompt": "x"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "image"
    r = httpx.post(
        url, files={"mask": ("m.png", _image_bytes("white"), "image/png")}, data={"prompt": "x"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    two = [("image", ("a.png", _image_bytes("red"), "image/png"))] * 2
    r = httpx.post(url, files=two, data={"prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"


def test_a_failing_request_leaves_the_server_up(server):
    # the pipeline refuses a mask of another size than its image (a FluxError inside the worker)
    files = {"image": ("in.png", _image_bytes("red"), "image/png"), "mask": ("m.png", _image_bytes("white", 32), "image/png")}  # fmt: skip
    r = httpx.post(
        server.url + "/v1/images/edits", files=files, data={"prompt": "a", "steps": "1"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert _post(server, {"prompt": "still here", **SMALL}).status_code == 200


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def readme_metrics() -> dict[str, tuple[str, tuple[str, ...], bool]]:
    """The documented table of /metrics (docs/serving.md): series name → (type, label names, CUDA only)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    rows = re.findall(
        r"^\| `(flux_serve_\w+)` \| (gauge|counter|histogram) \| ([^|]*) \| ([^|]*) \|$", text, re.M
    )
    assert len(rows) >= 8, "docs/serving.md's flux-serve metrics table is gone"
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels)), "CUDA only" in what)
            for name, kind, labels, what in rows}  # fmt: skip


def test_metrics_parse_and_are_the_readmes(server):
    assert _post(server, {"prompt": "count me", "seed": 1, **SMALL}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = [s for f in families.values() for s in f.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]  # no stray _created series
    exposed = {}
    for f in families.values():
        name = f.name + "_total" if f.type == "counter" else f.name
        labels = {k for s in f.samples for k in s.labels if k != "le"}
        exposed[name] = (f.type, tuple(sorted(labels)))
    documented = {
        n: (k, tuple(sorted(labels))) for n, (k, labels, cuda) in readme_metrics().items() if not cuda
    }
    assert exposed == documented  # the CPU server: every series but the GPU memory gauges
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert value[("flux_serve_requests_total", (("route", "/health"), ("status", "200")))] >= 1
    assert value[("flux_serve_requests_total", (("route", GEN), ("status", "200")))] >= 1
    assert value[("flux_serve_images_total", ())] >= 1 and value[("flux_serve_images_per_second", ())] > 0
    for stage in ("queue", "encode", "denoise", "decode", "total"):
        assert value[("flux_serve_stage_seconds_count", (("stage", stage),))] >= 1
    for reason in ("queue_full", "disconnected", "timeout", "abandoned"):  # made at start, before any drop
        assert ("flux_serve_dropped_total", (("reason", reason),)) in value
    assert value[("flux_serve_batch_images_sum", ())] >= value[("flux_serve_batch_images_count", ())] >= 1


def test_load_8_clients_every_request_answered_once(server):
    clients, each = 8, 3
    images_before = server.metric("flux_serve_images_total")

    def client(c: int) -> list[tuple[int, float, int]]:
        got = []
        with httpx.Client(timeout=120) as http:
            for k in range(each):
                seed = 1000 + c * each + k
                t = time.perf_counter()
                r = http.post(
                    server.url + GEN,
                    json={"prompt": f"client {c}", "seed": seed, "size": "64x64", "steps": 1},
                )
                assert r.status_code == 200, r.text
                got.append((seed, time.perf_counter() - t, _png(r.json()["data"][0]["b64_json"])[1]["seed"]))
        return got

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [x for part in pool.map(client, range(clients)) for x in part]
    wall = time.perf_counter() - began
    assert sorted(s for s, _, _ in results) == list(range(1000, 1000 + clients * each))
    assert all(sent == got for sent, _, got in results)  # each answer is its own request's image
    assert server.metric("flux_serve_images_total") == images_before + clients * each
    lat = sorted(t for _, t, _ in results)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    batched = server.metric("flux_serve_batch_images_sum") / max(
        server.metric("flux_serve_batch_images_count"), 1
    )
    print(f"\nload: {len(lat)} requests, p50 {statistics.median(lat):.2f} s, p99 {p99:.2f} s, "
          f"{len(lat) / wall:.1f} images/s, mean batch {batched:.2f}")  # fmt: skip
