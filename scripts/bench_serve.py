"""flux-serve under load: images/min, p50/p99 latency, with batching on and off; one line of JSON at the end.

For each mode it starts the real server (a `python -m flux_runtime.serve` process, or with `--random-weights`
this script's child, which builds the pipeline and hands it to the same `serve`) on 127.0.0.1 at a free
port, warms it up (every batch size once, so CUDA graphs are captured before the clock starts), then fires
`--requests` text-to-image requests from `--concurrency` httpx clients, each with its own seed, and checks
that every one is answered once with its own image (the PNG provenance's seed). Server-side numbers (mean
batch, per-stage seconds, peak GPU memory) come from its /metrics.

    python3 scripts/bench_serve.py                                      # the trained tiny model on CUDA
    python3 scripts/bench_serve.py --model flux1-dev --random-weights   # FLUX.1-dev, 1024², 28 steps

    python3 scripts/bench_serve.py --model /tmp/cold/flux1-dev --compare-replicas --modes batching
                                      # one process, then one Ray Serve replica, same model folder

`--replicas N` starts `flux-serve --replicas N` instead (a Ray Serve deployment of N replicas on a local Ray
instance whose driver is the flux-serve process) and reports the same figures, with how many answers each
replica gave (the `X-Flux-Replica` header); after it stops, the Ray processes it started must be gone within
30 s. `--compare-replicas` runs each mode in one process and then on `--replicas` (default 1) back to back and
reports Ray's overhead: the Ray run's images/min and p50 as ratios of the one process's. A replica builds its own
pipeline from `--model`, so a full-size model is a folder there (scripts/bench_cold_start.py `build` writes
random-weight ones), not `--random-weights`.

`--random-weights` builds FLUX.1-dev at full size with seeded random weights (the 11.9 B transformer and
the autoencoder from the runtime's presets, full-size CLIP-L and T5-XXL from transformers' classes with the
shipped tiny tokenizers), so nothing is downloaded; the images are noise, the work is the real model's.

The server needs fastapi, uvicorn, httpx, prometheus_client, python-multipart and pydantic. Where they are
missing (the GPU device has no registry), the script installs the wheels of `--wheels` (default .whl/serve,
made by scripts/fetch_serve_wheels.sh) into /tmp/serve-site with pip --no-index and runs itself again with
that folder first on PYTHONPATH. With `--replicas` Ray is needed too: the wheels of `--ray-wheels` (default
.whl/ray, made by scripts/fetch_ray_wheels.sh, the Ray package itself as an unpacked, pruned tree in a .tar.xz)
go into /tmp/ray-site the same way.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import contextlib
import importlib.util
import io
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("fastapi", "uvicorn", "httpx", "prometheus_client", "multipart", "pydantic")
SITE = Path("/tmp/serve-site")
RAY_SITE = Path("/tmp/ray-site")
REPLICA_HEADER = (
    "X-Flux-Replica"  # flux_runtime.serve.app.REPLICA_HEADER (not imported: the client side needs no app)
)
RAY_PUSH_S = (
    6.0  # a replica pushes its metrics every 5 s (replicas.PUSH_EVERY): wait this long for the others'
)
RAY_READY = "flux-serve: every replica is ready"  # flux-serve --replicas' line once the deployment is up
RAY_EXIT_S = 30.0  # how long Ray's processes may take to end after flux-serve stops
CHILD = "--serve-random-flux1"  # argv[1] of the child process that serves a random full-size FLUX.1-dev
RANDOM_MODELS = ("flux1-dev",)


# ------------------------------------------------------------------------------------------- packages
def ensure_packages(wheels: Path, ray_wheels: Path | None = None) -> None:
    """Import the server's packages (and Ray's, where `ray_wheels` is given), installing `wheels` into SITE and
    `ray_wheels` into RAY_SITE and re-running this script with both on PYTHONPATH if needed: the GPU device has
    no package registry, only what a call carries."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    ray_missing = ray_wheels is not None and importlib.util.find_spec("ray") is None
    if not missing and not ray_missing:
        return
    if os.environ.get("FLUX_BENCH_SERVE_SITE") == str(SITE):
        still = missing + (["ray"] if ray_missing else [])
        raise SystemExit(f"bench_serve: {', '.join(still)} still missing after installing the wheels")
    sites = []
    if missing:
        _install(wheels, SITE, [], "scripts/fetch_serve_wheels.sh", f"missing {', '.join(missing)}")
        sites.append(SITE)
    if ray_missing:
        assert ray_wheels is not None
        trees = sorted(ray_wheels.glob("ray-*.tar.xz"))
        _install(ray_wheels, RAY_SITE, trees, "scripts/fetch_ray_wheels.sh", "--replicas needs ray")
        sites.append(RAY_SITE)
    env = {**os.environ, "FLUX_BENCH_SERVE_SITE": str(SITE)}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (*map(str, sites), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _install(wheels: Path, site: Path, trees: list[Path], fetch: str, why: str) -> None:
    """`wheels`' *.whl into `site` with pip --no-index (no dependency resolution: the set is complete), then
    each unpacked package tree of `trees` (.tar.xz) over it."""
    found = sorted(wheels.glob("*.whl"))
    if not found and not trees:
        raise SystemExit(
            f"bench_serve: {why} and no wheels in {wheels}: run {fetch} where pip reaches PyPI and carry {wheels}"
        )
    print(
        f"bench_serve: installing {len(found)} wheels, {len(trees)} trees from {wheels} into {site}",
        file=sys.stderr,
    )
    if found:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)],
            check=True,
        )  # fmt: skip
    for tree in trees:
        with tarfile.open(tree) as tar:
            tar.extractall(site, filter="tar")  # keeps the modes: Ray's raylet and gcs_server are programs


# ------------------------------------------------------------------------------------------- random weights
def random_flux1_pipeline(
    *,
    device: Any,
    dtype: Any,
    quality: str = "lossless",
    cuda_graphs: bool = True,
    fp8: bool = False,
    model_name: str = "flux1-dev",
    dit: Any = None,
    vae: Any = None,
    clip: Any = None,
    t5: Any = None,
    seed: int = 0,
) -> Any:
    """A FLUX.1 [dev] `Pipeline` with seeded random weights: by default FLUX.1-dev's full-size transformer and
    autoencoder (the runtime's presets) and CLIP-L / T5-XXL text towers (transformers configs); the configs
    may be given smaller (the test builds a tiny one on the CPU). Drawn on `device`, so 12 B weights take
    seconds; the same seed gives the same weights on one device type, not across them."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from flux_runtime.models.dit import PRESETS, Flux1Transformer
    from flux_runtime.models.vae.flux1 import FLUX1_VAE
    from flux_runtime.pipeline import Pipeline
    from flux_runtime.sampling import FLUX1_DEV_SCHEDULE
    from flux_runtime.text import Flux1TextEncoder
    from flux_runtime.text.tokenizers import load_clip_tokenizer, load_t5_tokenizer, tiny_tokenizer_path
    from flux_runtime.weights.checkpoint import finish_builtin
    from flux_runtime.weights.vae import build_vae

    device = torch.device(device)
    clip = clip or CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, pad_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    t5 = t5 or T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        transformer = Flux1Transformer(dit or PRESETS["flux1-dev"])
        autoencoder = build_vae(vae or FLUX1_VAE)
    _randomize(transformer, seed, device, dtype)
    _randomize(autoencoder, seed + 1, device, dtype)
    transformer = finish_builtin(transformer, dtype, fp8)
    # transformers' initializers draw from the global generators: fork them, leave the caller's as they were
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.device(device):
        torch.manual_seed(seed + 2)
        clip_model = CLIPTextModel(clip).to(dtype).eval()
        t5_model = T5EncoderModel(t5).to(dtype).eval()
    for model in (clip_model, t5_model):
        model.requires_grad_(False)
    text = Flux1TextEncoder(
        clip_model,
        load_clip_tokenizer(tiny_tokenizer_path("clip")),
        t5_model,
        load_t5_tokenizer(tiny_tokenizer_path("t5")),
    )
    return Pipeline(
        transformer, autoencoder.eval(), text, schedule=FLUX1_DEV_SCHEDULE, model_name=model_name,
        weights_id=f"{model_name}-random-seed{seed}", quality=quality, cuda_graphs=cuda_graphs,
    )  # fmt: skip


def _randomize(model: Any, seed: int, device: Any, dtype: Any) -> None:
    """Every parameter of `model` (on meta) drawn on `device` as the runtime's built-in random models draw
    theirs: matrices U(±1/sqrt(fan_in)), norm scales near 1, biases near 0."""
    import torch
    from torch import nn

    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            value = torch.empty(param.shape, device=device, dtype=torch.float32)
            if param.ndim >= 2:
                bound = 1.0 / math.sqrt(param.shape[1])
                value.uniform_(-bound, bound, generator=gen)
            elif name.endswith(("scale", "norm.weight")) or (".norm" in name and name.endswith("weight")):
                value.normal_(1.0, 0.1, generator=gen)
            else:
                value.normal_(0.0, 0.02, generator=gen)
            module_name, _, attr = name.rpartition(".")
            setattr(
                model.get_submodule(module_name), attr, nn.Parameter(value.to(dtype), requires_grad=False)
            )


def serve_random(argv: list[str]) -> None:
    """The child: flux-serve's options in `argv`, a random full-size pipeline instead of a checkpoint."""
    from flux_runtime.pipeline.checks import check_device
    from flux_runtime.serve.command import serve
    from flux_runtime.serve.options import dtype_of, parse

    opts = parse(list(argv))
    if opts["model"] not in RANDOM_MODELS:
        raise SystemExit(f"--random-weights builds {', '.join(RANDOM_MODELS)}, not {opts['model']!r}")
    device = check_device(opts["device"])

    def build() -> Any:  # on the server's worker thread, while the port answers /health
        began = time.perf_counter()
        pipe = random_flux1_pipeline(
            device=device, dtype=dtype_of(opts, device), quality=opts["quality"],
            cuda_graphs=not opts["no_cuda_graphs"], fp8=opts["fp8"], model_name=opts["model"],
        )  # fmt: skip
        print(
            f"bench_serve: random {opts['model']} built in {time.perf_counter() - began:.1f} s",
            file=sys.stderr,
        )
        return pipe

    serve(build, opts)


# ------------------------------------------------------------------------------------------- the server
class Server:
    """One flux-serve process on 127.0.0.1 at a free port, or with `replicas` a Ray Serve deployment of that many
    replicas driven by it; its output goes to `log`."""

    def __init__(
        self,
        args: list[str],
        *,
        model: str,
        random_weights: bool,
        log: Path,
        start_timeout: float,
        replicas: int | None = None,
    ) -> None:
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        cmd = [
            sys.executable,
            *([str(Path(__file__).resolve()), CHILD] if random_weights else ["-m", "flux_runtime.serve"]),
        ]
        cmd += [*args, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--replicas", str(replicas)] if replicas else []
        self.replicas = replicas
        self.ray_before = ray_processes() if replicas else set()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
        began = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    # under Ray a replica answers: its pid is not ours, but it names itself
                    ours = (
                        "replica" in health.json() if replicas else health.json().get("pid") == self.proc.pid
                    )
                    if not ours or health.json().get("model") != model:
                        self.stop()  # another process took the port first
                        raise SystemExit(f"bench_serve: {self.url} is not the server started: {health.text}")
                    # loaded and warmed up once (/ready's answer); under Ray also every replica, as flux-serve
                    # says once `serve.run` returns: it takes SIGTERM as its signal to stop only from then on
                    if health.json().get("ready") and (
                        not replicas or RAY_READY in log.read_text(errors="replace")
                    ):
                        break
            except httpx.TransportError:
                pass
            if time.monotonic() - began > start_timeout:
                self.stop()
                raise SystemExit(f"bench_serve: not ready within {start_timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)
        self.start_s = time.monotonic() - began

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels): value}; under Ray every replica's series summed (their
        `replica` label dropped), the other replicas' as of their latest push."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        if self.replicas and self.replicas > 1:
            time.sleep(RAY_PUSH_S)  # the others' pushes catch up with what was just done
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[tuple[str, tuple], float] = collections.defaultdict(float)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))
                out[(s.name, labels)] += s.value
        return dict(out)

    def stop(self) -> int:
        """SIGTERM, up to 120 s to finish (under Ray: take the application and the local Ray instance down)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def ray_leftovers(self) -> list[str]:
        """The Ray processes that appeared while this server ran and are still there RAY_EXIT_S after it stopped
        (none when Ray shut down cleanly); those still there are ended (SIGKILL, by pid) so that the next run
        starts clean, and named here."""
        if not self.replicas:
            return []
        deadline = time.monotonic() + RAY_EXIT_S
        while True:
            left = ray_processes() - self.ray_before
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return sorted(f"{pid} {cmd}" for pid, cmd in left)


def ray_processes() -> set[tuple[int, str]]:
    """(pid, command line) of every process that is part of a Ray instance on this machine: its programs and
    workers run from the ray package's folder, and workers rename themselves `ray::...`."""
    spec = importlib.util.find_spec("ray")
    marks = [f"{folder}/" for folder in (spec.submodule_search_locations or [])] if spec else []
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if cmd.startswith("ray::") or any(mark in cmd for mark in marks):
            found.add((int(entry.name), cmd[:160]))
    return found


# ------------------------------------------------------------------------------------------- the load
def request_body(seed: int, args: argparse.Namespace, steps: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": f"a photograph, request {seed}", "seed": seed, "n": 1}
    if args.size:
        body["size"] = f"{args.size}x{args.size}"
    if steps is not None:
        body["steps"] = steps
    return body


def fire(url: str, seeds: list[int], args: argparse.Namespace, steps: int | None, clients: int) -> list[dict]:
    """POST one request per seed from `clients` concurrent httpx clients; each answer's status, latency and
    the seed and size its PNG's provenance records."""
    import httpx
    from PIL import Image

    def one(http: Any, seed: int) -> dict[str, Any]:
        t = time.perf_counter()
        try:
            r = http.post(url + "/v1/images/generations", json=request_body(seed, args, steps))
        except httpx.HTTPError as e:
            return {"sent": seed, "status": 0, "error": f"{type(e).__name__}: {e}"}
        latency = time.perf_counter() - t
        if r.status_code != 200:
            return {"sent": seed, "status": r.status_code, "error": r.text[:200], "latency": latency}
        image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
        info = json.loads(image.text["flux_runtime"])
        return {"sent": seed, "status": 200, "latency": latency, "got": info["seed"], "info": info,
                "replica": r.headers.get(REPLICA_HEADER)}  # fmt: skip

    def client(part: list[int]) -> list[dict[str, Any]]:
        with httpx.Client(timeout=args.request_timeout) as http:
            return [one(http, seed) for seed in part]

    parts = [seeds[i::clients] for i in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [x for part in pool.map(client, parts) for x in part]


def warm_up(server: Server, args: argparse.Namespace, batching: bool) -> None:
    """Every batch size once at 2 steps (CUDA graphs are per shape, not per step count): k requests at once
    on an idle worker run as a batch of 1 and one of k - 1. With several Ray replicas the round is repeated
    once per replica, since Ray's router spreads each round's requests over them (most, not surely every,
    replica then sees every size; one replica sees them all)."""
    sizes = list(range(2, args.max_batch + 2) if batching else [1]) * (server.replicas or 1)
    seed = 10**6
    for k in sizes:
        got = fire(server.url, list(range(seed, seed + k)), args, 2, k)
        seed += k
        bad = [g for g in got if g["status"] != 200]
        if bad:
            raise SystemExit(f"bench_serve: warm-up request failed: {bad[0]}\n{server.tail()}")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _delta(after: dict, before: dict, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def run_mode(
    args: argparse.Namespace, batching: bool, log_dir: Path, replicas: int | None = None
) -> dict[str, Any]:
    """Start a server (one process, or `replicas` on Ray Serve), warm it, measure the load, stop it; the
    mode's numbers."""
    server_args = ["--model", args.model, "--max-batch", str(args.max_batch), "--max-n", "1",
                   "--max-queue", str(max(16, 2 * args.concurrency)), "--timeout", str(args.request_timeout),
                   "--store-max", "1", "--quality", args.quality]  # fmt: skip
    server_args += ["--device", args.device] if args.device else []
    server_args += [] if batching else ["--no-batching"]
    server_args += ["--fp8"] if args.fp8 else []
    server_args += ["--no-cuda-graphs"] if args.no_cuda_graphs else []
    mode = mode_key(batching, replicas)
    server = Server(server_args, model=args.model, random_weights=args.random_weights, log=log_dir / f"server_{mode}.log",
                    start_timeout=args.start_timeout, replicas=replicas)  # fmt: skip
    leftovers: list[str] = []
    try:
        if args.warmup:
            warm_up(server, args, batching)
        before = server.metrics()
        seeds = list(range(args.requests))
        began = time.perf_counter()
        answers = fire(server.url, seeds, args, args.steps, args.concurrency)
        wall = time.perf_counter() - began
        after = server.metrics()
    finally:
        code = server.stop()
        leftovers = server.ray_leftovers()
        if leftovers:
            print(
                f"bench_serve: {mode}: Ray processes left after the server stopped: {leftovers}",
                file=sys.stderr,
            )
    ok = [a for a in answers if a["status"] == 200]
    latencies = [a["latency"] for a in ok]
    calls = _delta(after, before, "flux_serve_batch_images_count")
    stage = {
        s: _delta(after, before, "flux_serve_stage_seconds_sum", (("stage", s),))
        / max(_delta(after, before, "flux_serve_stage_seconds_count", (("stage", s),)), 1)
        for s in ("queue", "encode", "denoise", "decode")
    }
    info = ok[0]["info"] if ok else {}
    peak = after.get(("flux_serve_gpu_memory_bytes", (("kind", "max_allocated"),)))  # None off CUDA
    return {
        "requests": len(answers),
        "answered": len(ok),
        "errors": [f"{a['status']}: {a.get('error', '')}" for a in answers if a["status"] != 200][:5],
        "every_request_answered_once_with_its_seed": sorted(a.get("got", -1) for a in ok) == seeds
        and all(a["got"] == a["sent"] for a in ok),
        "wall_s": round(wall, 3),
        "images_per_min": round(60 * len(ok) / wall, 3),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_s": round(percentile(latencies, 99), 3) if latencies else None,
        "mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "mean_batch": round(_delta(after, before, "flux_serve_batch_images_sum") / calls, 3)
        if calls
        else None,
        "pipeline_calls": int(calls),
        "stage_mean_s": {k: round(v, 4) for k, v in stage.items()},
        "gpu_max_allocated_gib": None if peak is None else round(peak / 2**30, 2),
        "size": f"{info.get('width')}x{info.get('height')}",
        "steps": info.get("num_steps"),
        "weights": info.get("weights"),
        "device": info.get("device"),
        "server_start_s": round(server.start_s, 1),
        "server_exit": code,
        **(
            {"replicas": replicas, "answers_per_replica": dict(collections.Counter(a["replica"] for a in ok)),
             "ray_processes_left": leftovers}
            if replicas
            else {}
        ),
    }  # fmt: skip


def mode_key(batching: bool, replicas: int | None) -> str:
    """A run's key in the summary: `batching` / `no_batching` in one process, `..._ray<N>` on N replicas."""
    return ("batching" if batching else "no_batching") + (f"_ray{replicas}" if replicas else "")


def ray_overhead(one: dict[str, Any], ray: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve's cost against one process for the same load: the Ray run's images/min and p50 / p99 as
    ratios of the one process's, and the throughput lost in percent (issue 40 asks for <= 3 % on one replica)."""
    ratio = ray["images_per_min"] / one["images_per_min"] if one["images_per_min"] else None
    return {
        "images_per_min_ratio": None if ratio is None else round(ratio, 4),
        "throughput_loss_pct": None if ratio is None else round(100 * (1 - ratio), 2),
        "p50_ratio": round(ray["p50_s"] / one["p50_s"], 4) if one["p50_s"] and ray["p50_s"] else None,
        "p99_ratio": round(ray["p99_s"] / one["p99_s"], 4) if one["p99_s"] and ray["p99_s"] else None,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        serve_random(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="what flux-serve --model loads [tiny]")
    ap.add_argument(
        "--random-weights", action="store_true", help=f"random full-size weights ({', '.join(RANDOM_MODELS)})"
    )
    ap.add_argument("--device", default=None, help="flux-serve --device [cuda if available]")
    ap.add_argument(
        "--size",
        type=int,
        default=None,
        help="square side in px [the model's default: tiny 256, FLUX.1 1024]",
    )
    ap.add_argument("--steps", type=int, default=None, help="[the model's default: 28]")
    ap.add_argument("--requests", type=int, default=16, help="measured requests per mode (one image each)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    ap.add_argument("--max-batch", type=int, default=4, help="flux-serve --max-batch")
    ap.add_argument("--modes", default="batching,no_batching", help="which of batching,no_batching to run")
    ap.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run flux-serve --replicas N (Ray Serve) instead of one process",
    )
    ap.add_argument(
        "--compare-replicas",
        action="store_true",
        help="each mode in one process, then on --replicas (default 1) Ray Serve replicas; Ray's overhead",
    )
    ap.add_argument("--quality", default="lossless", choices=["lossless", "high"])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="measure from a cold server")
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl" / "serve")
    ap.add_argument(
        "--ray-wheels", type=Path, default=ROOT / ".whl" / "ray", help="for --replicas where ray is missing"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--log-dir", type=Path, default=None, help="the servers' logs [a temporary folder]")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"batching", "no_batching"}:
        ap.error(f"--modes {args.modes!r}: give batching, no_batching or both")
    if args.random_weights and args.model not in RANDOM_MODELS:
        ap.error(f"--random-weights builds {', '.join(RANDOM_MODELS)}, not {args.model!r}")
    if args.requests < 1 or args.concurrency < 1 or args.max_batch < 1:
        ap.error("--requests, --concurrency and --max-batch must be >= 1")
    if Path(args.model).is_dir():  # a folder: absolute, since a Ray replica does not run in this folder
        args.model = str(Path(args.model).resolve())
    if args.compare_replicas and args.replicas is None:
        args.replicas = 1
    if args.replicas is not None and args.replicas < 1:
        ap.error("--replicas must be >= 1")
    if args.replicas and args.random_weights:
        ap.error("a Ray replica builds its pipeline from --model: give a model folder, not --random-weights")
    ensure_packages(args.wheels, args.ray_wheels if args.replicas else None)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    runs = [
        (mode == "batching", n)
        for mode in modes
        for n in ([None, args.replicas] if args.compare_replicas else [args.replicas])
    ]
    results = {}
    for batching, replicas in runs:
        mode = mode_key(batching, replicas)
        print(f"bench_serve: {args.model} {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_mode(args, batching, log_dir, replicas)
        r = results[mode]
        for error in r["errors"]:
            print(f"bench_serve: {mode}: a request failed: {error}", file=sys.stderr)
        per_replica = f", per replica {r['answers_per_replica']}" if replicas else ""
        print(
            f"bench_serve: {mode}: {r['answered']}/{r['requests']} answered, {r['images_per_min']} images/min, "
            f"p50 {r['p50_s']} s, p99 {r['p99_s']} s, mean batch {r['mean_batch']}{per_replica}",
            file=sys.stderr,
            flush=True,
        )
    print()
    weights = " (random weights)" if args.random_weights else ""
    print(
        f"| flux-serve {args.model}{weights}, {args.concurrency} clients x {args.requests} requests "
        "| images/min | p50 s | p99 s | mean batch | denoise s/call | all answered once |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} ({r['size']}, {r['steps']} steps, {r['device']}) | {r['images_per_min']:.1f} "
            f"| {r['p50_s']} | {r['p99_s']} | {r['mean_batch']} | {r['stage_mean_s']['denoise']} "
            f"| {r['every_request_answered_once_with_its_seed']} |"
        )
    summary: dict[str, Any] = {
        "bench": "serve", "model": args.model, "random_weights": args.random_weights,
        "concurrency": args.concurrency, "max_batch": args.max_batch, "quality": args.quality, "fp8": args.fp8,
        "cuda_graphs": not args.no_cuda_graphs, "warmup": args.warmup, "replicas": args.replicas, **results,
    }  # fmt: skip
    if args.compare_replicas:
        summary["ray_overhead"] = {
            mode: ray_overhead(results[mode], results[mode_key(mode == "batching", args.replicas)])
            for mode in modes
        }
        for mode, o in summary["ray_overhead"].items():
            print(
                f"Ray Serve, {args.replicas} replica(s) vs one process, {mode}: images/min x{o['images_per_min_ratio']} "
                f"({o['throughput_loss_pct']} % lost), p50 x{o['p50_ratio']}, p99 x{o['p99_ratio']}"
            )
    if "batching" in results and "no_batching" in results and results["no_batching"]["images_per_min"]:
        summary["batching_speedup"] = round(
            results["batching"]["images_per_min"] / results["no_batching"]["images_per_min"], 3
        )
    line = json.dumps(summary, separators=(",", ":"))
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    good = all(
        r["every_request_answered_once_with_its_seed"] and r["answered"] == r["requests"]
        and not r.get("ray_processes_left")
        for r in results.values()
    )  # fmt: skip
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
