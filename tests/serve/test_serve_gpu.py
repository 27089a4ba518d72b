"""flux-serve on a CUDA GPU (bf16, CUDA graphs, batching off): a served text-to-image and a FLUX.2 reference
edit are the same bits as the same `Pipeline` call in this process, and /metrics reports the GPU's memory.
Needs no openai client, so it runs on the device with the wheels of scripts/fetch_serve_wheels.sh."""

from __future__ import annotations

import io

import httpx
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from flux_runtime.pipeline import Pipeline
from tests.serve.images import first_rgb as _served
from tests.serve.images import random_png as _png
from tests.serve.server import Server

pytestmark = pytest.mark.gpu


def test_served_on_cuda_is_the_pipelines_image_and_metrics_report_the_gpu(tmp_path):
    srv = Server("--model", "tiny", "--device", "cuda", "--no-batching", store=tmp_path)
    try:
        body = {"prompt": "a red circle on a blue background", "seed": 3, "size": "128x128", "steps": 4}
        image, info = _served(httpx.post(srv.url + "/v1/images/generations", json=body, timeout=300))
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    pipe = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16)
    direct = pipe(body["prompt"], seed=3, width=128, height=128, num_steps=4)
    assert image.tobytes() == direct.images[0].tobytes()
    assert (info["device"], info["dtype"], info["cuda_graphs"]) == (direct.info["device"], "bfloat16", True)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    memory = {s.labels["kind"]: s.value for s in families["flux_serve_gpu_memory_bytes"].samples}
    assert set(memory) == {"allocated", "reserved", "max_allocated", "total"}
    assert 0 < memory["allocated"] <= memory["max_allocated"] <= memory["reserved"] <= memory["total"]


def test_flux2_reference_edit_on_cuda_is_the_pipelines_image(tmp_path):
    uploads = [_png(64, 64, 1), _png(80, 64, 2)]
    srv = Server("--model", "tiny-flux2", "--device", "cuda", "--no-batching", store=tmp_path)
    try:
        files = [("image", (f"r{i}.png", d, "image/png")) for i, d in enumerate(uploads)]
        r = httpx.post(srv.url + "/v1/images/edits", files=files, data={"prompt": "a cat", "seed": "2",
                       "steps": "3"}, timeout=300)  # fmt: skip
        image, _ = _served(r)
    finally:
        srv.stop()
    pipe = Pipeline.from_pretrained("tiny-flux2", device="cuda", dtype=torch.bfloat16)
    refs = [Image.open(io.BytesIO(d)) for d in uploads]
    direct = pipe("a cat", image=refs, seed=2, num_steps=3)
    assert image.tobytes() == direct.images[0].tobytes()
