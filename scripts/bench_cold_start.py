#!/usr/bin/env python3
"""Time to first image, as a user meets it: fresh processes from the command to the PNG, ours against diffusers.

Device only (a CUDA GPU, diffusers importable). Four steps, each a subcommand, results as JSON lines in --out:

- `build ROOT`: full-size random pipeline folders written by diffusers and transformers, laid out as on the Hub:
  `ROOT/flux1-dev` (FLUX.1-dev transformer, FLUX.1 VAE, CLIP-L, T5-XXL in bf16, sharded like the real repo) and
  `ROOT/klein-4b` (FLUX.2 [klein] 4B transformer, FLUX.2 VAE, Qwen3-4B). The tokenizers are the package's tiny
  ones (their ids lie inside the real vocabularies), so nothing is downloaded.
- `read ROOT`: the transformer's read rate, page cache warm, against this machine's limits measured in the same
  run: a pinned host → GPU copy alone; the pinned-ring pattern without any loader work (16 readers, 32 MiB
  buffers: the bandwidth ceiling of a read from the page cache); our `load_transformer`; the libraries
  `safetensors` (`load_file(device="cuda")`), `fastsafetensors` (nogds) and `runai-model-streamer`, where
  importable. With `--cold`, the page cache is dropped before each (root only) and the disk's own rate is read
  with `dd` first.
- `cold ROOT`: in fresh processes, `flux-gen --model DIR` (bf16 and `--fp8`) and a diffusers script doing the
  same call, each timed from the command to the PNG (wall, and the stages each process prints), the PNGs
  compared pixel for pixel; `flux-gen --prompts` with 8 prompts (per-image time after the first); peak host RSS
  of each process.
- `first-call ROOT`: where a fresh process's first image goes against its second, in one process per model:
  torch's import, the CUDA context, our imports, the load, then two identical calls (no CUDA graphs, as
  `flux-gen` makes one image) timed per stage (encode, first step, the other steps, decode, from the
  pipeline's progress reports with the GPU synchronized), and how long the process takes to exit.
- `imports ROOT`: what a fresh process spends before any weights: torch alone, a CUDA context, triton, our
  pipeline and CLI, transformers' text encoders, diffusers' FluxPipeline, each in its own process; then the
  heaviest modules of our imports (`python -X importtime`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPT = "a red fox in the snow, golden hour, photograph"
GiB = 2**30


def _emit(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------------ build


def _fill(model, seed: int):
    import torch

    sys.path.insert(0, str(HERE))
    from random_fill import fill_module

    gen = torch.Generator("cuda").manual_seed(seed)
    fill_module(model, torch.device("cuda"), gen, position_buffers=True)
    return model


def _tokenizer(name: str, dst: Path) -> None:
    from flux_runtime.text.tokenizers import TINY_TOKENIZERS

    shutil.copytree(TINY_TOKENIZERS / name, dst, dirs_exist_ok=True)


def _scheduler(dst: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    ).save_pretrained(dst)  # fmt: skip


def _save(model, dst: Path, shard: str) -> None:
    """Write a GPU-filled model from the host, as the Hub's files are (safetensors, sharded at `shard`)."""
    model.to("cpu").save_pretrained(dst, max_shard_size=shard)
    del model


def build_flux1(root: Path) -> Path:
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    d = root / "flux1-dev"
    if (d / "model_index.json").is_file():
        return d
    bf = torch.bfloat16
    with torch.device("meta"):
        dit = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ).to(bf)  # fmt: skip
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
            layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        ).to(bf)  # fmt: skip
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
            )
        ).to(bf)  # fmt: skip
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
            )
        ).to(bf)  # fmt: skip
    _save(_fill(dit, 1), d / "transformer", "10GB")
    _save(_fill(vae, 2), d / "vae", "10GB")
    _save(_fill(clip, 3), d / "text_encoder", "10GB")
    _save(_fill(t5, 4), d / "text_encoder_2", "5GB")
    _tokenizer("clip", d / "tokenizer")
    _tokenizer("t5", d / "tokenizer_2")
    _scheduler(d / "scheduler")
    index = {
        "_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
    }  # fmt: skip
    (d / "model_index.json").write_text(json.dumps(index, indent=2))
    torch.cuda.empty_cache()
    return d


def build_klein(root: Path) -> Path:
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = root / "klein-4b"
    if (d / "model_index.json").is_file():
        return d
    bf = torch.bfloat16
    with torch.device("meta"):
        dit = Flux2Transformer2DModel(
            num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
            guidance_embeds=False,
        ).to(bf)  # fmt: skip
        vae = AutoencoderKLFlux2().to(bf)
        llm = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True,
            )
        ).to(bf)  # fmt: skip
    _save(_fill(dit, 5), d / "transformer", "10GB")
    _save(_fill(vae, 6), d / "vae", "10GB")
    _save(_fill(llm, 7), d / "text_encoder", "5GB")  # RoPE frequencies are not saved: no need to refill them
    _tokenizer("qwen3", d / "tokenizer")
    _scheduler(d / "scheduler")
    index = {
        "_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.42.1", "is_distilled": True,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
    }  # fmt: skip
    (d / "model_index.json").write_text(json.dumps(index, indent=2))
    torch.cuda.empty_cache()
    return d


def cmd_build(args: argparse.Namespace) -> None:
    for name, build in (("flux1-dev", build_flux1), ("klein-4b", build_klein)):
        if name not in args.models:
            continue
        t0 = time.perf_counter()
        d = build(args.root)
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        _emit(args.out, {"build": name, "s": round(time.perf_counter() - t0, 1), "GB": round(size / 1e9, 2)})


# ------------------------------------------------------------------------------------------------------- read


def _drop_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _timed(fn) -> tuple[float, object]:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, value


def ring_limit(files: list[Path], threads: int, buffer_mb: int, slots: int) -> float:
    """Seconds to move `files` through the pinned-ring pattern alone: readers → pinned buffers → one GPU buffer."""
    import torch

    from flux_runtime.weights.pinned_stream import DeviceStream, PinnedRing, RingShape, Span

    ring = PinnedRing(RingShape(threads, slots, buffer_mb << 20))
    plan = [Span(f"{f}:{i}", f, i, min(1 << 30, f.stat().st_size - i)) for f in files
            for i in range(0, f.stat().st_size, 1 << 30)]  # fmt: skip
    try:

        def go():
            stream = DeviceStream(plan, torch.device("cuda", 0), ring)
            for s in plan:
                stream.take(s.key)  # each GiB freed as it lands: no loader work at all
            stream.close()

        return _timed(go)[0]
    finally:
        ring.release()


def pinned_copy_rate() -> float:
    """GB/s of a pinned host → GPU copy alone (1 GiB, eight times): the PCIe side of the limit."""
    import torch

    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    s, _ = _timed(lambda: [dev.copy_(host, non_blocking=True) for _ in range(8)])
    return 8 * (1 << 30) / 1e9 / s


def per_tensor_windows(plan: list, buffer_bytes: int, packed: Callable) -> tuple[list, list]:
    """`packed` (`pinned_stream.plan_windows`) with every tensor in reads of its own (no buffer shared by small
    tensors): the A/B row of `read`."""
    from dataclasses import replace

    windows: list = []
    pieces: list = []
    for span in plan:
        own_windows, (own,) = packed([span], buffer_bytes)
        pieces.append([replace(p, window=p.window + len(windows)) for p in own])
        windows += own_windows
    return windows, pieces


def cmd_read(args: argparse.Namespace) -> None:
    import torch

    folder = args.root / "flux1-dev" / "transformer"
    files = _files(folder)
    total = sum(f.stat().st_size for f in files)
    gb = total / 1e9
    row = {"read": str(folder), "GB": round(gb, 2), "cold": args.cold}

    def rate(name: str, seconds: float) -> None:
        row[name] = round(gb / seconds, 2)
        print(f"{name}: {seconds:.2f} s, {gb / seconds:.2f} GB/s", flush=True)

    def prepare() -> None:
        if args.cold and not _drop_cache():
            row["cold"] = "page cache could not be dropped"
        elif not args.cold:
            for f in files:  # warm
                subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)

    if args.cold:
        prepare()
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={files[0]}", "of=/dev/null", "bs=64M"], capture_output=True, check=True)
        rate("disk dd (first shard)", (time.perf_counter() - t0) * total / files[0].stat().st_size)
    row["pinned copy alone"] = round(pinned_copy_rate(), 2)
    from flux_runtime.weights.pinned_stream import PinnedRing, RingShape

    t0 = time.perf_counter()
    PinnedRing(RingShape.default()).release()  # what flux-gen's prepare_ring moves out of the load
    row["seconds to page-lock the default ring"] = round(time.perf_counter() - t0, 3)
    for threads, buffer_mb, slots in args.ring:
        prepare()
        rate(f"ring {threads}x{buffer_mb}MiBx{slots}", ring_limit(files, threads, buffer_mb, slots))
    from flux_runtime.weights import load_transformer
    from flux_runtime.weights.safetensors_io import TensorSource

    torch.cuda.empty_cache()
    sizes = [TensorSource(files).shape(k) for k in TensorSource(files).keys()]
    s, kept = _timed(lambda: [torch.empty(sz, dtype=torch.bfloat16, device="cuda") for sz in sizes])
    rate("allocation alone (the model's tensors, fresh)", s)
    del kept
    prepare()
    s, model = _timed(lambda: load_transformer(folder, device="cuda", dtype=torch.bfloat16))
    rate("ours load_transformer (allocator warm)", s)
    del model
    torch.cuda.empty_cache()

    def counted_load(name: str) -> None:
        """One timed load and the cudaMalloc calls it made (segments allocated)."""
        prepare()
        before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        s, model = _timed(lambda: load_transformer(folder, device="cuda", dtype=torch.bfloat16))
        rate(name, s)
        row[f"{name}: cudaMalloc calls"] = torch.cuda.memory_stats().get("segment.all.allocated", 0) - before
        del model
        torch.cuda.empty_cache()

    for _ in range(args.repeat):
        counted_load("ours load_transformer")
    src = TensorSource(files)
    order = src.keys()

    def stream_only():
        with src.streaming(order, "cuda"):
            return [src.get(k, "cuda") for k in order]

    prepare()
    s, kept = _timed(stream_only)
    rate("ours stream alone (file order, kept)", s)
    del kept
    torch.cuda.empty_cache()
    # Is the main thread, which issues every tensor's copies (1313 tensors against the pattern's 24 spans), waiting
    # for the GIL that the readers take between their reads? A shorter switch interval hands it over sooner
    # (Python's default is 5 ms); fewer readers contend less.
    interval = sys.getswitchinterval()
    for label, threads, switch in (
        ("switch interval 0.2 ms", None, 0.0002), ("8 readers", 8, None), ("4 readers", 4, None),
    ):  # fmt: skip
        if threads is not None:
            os.environ["FLUX_LOAD_THREADS"] = str(threads)
        if switch is not None:
            sys.setswitchinterval(switch)
        try:
            for name, fn in (
                ("stream alone", stream_only),
                ("load_transformer", lambda: load_transformer(folder, device="cuda", dtype=torch.bfloat16)),
            ):
                prepare()
                s, kept = _timed(fn)
                rate(f"ours {name}, {label}", s)
                del kept
                torch.cuda.empty_cache()
        finally:
            os.environ.pop("FLUX_LOAD_THREADS", None)
            sys.setswitchinterval(interval)
    # the same two with a read of its own for each tensor (the stream before back-to-back tensors shared buffers)
    from flux_runtime.weights import pinned_stream

    packed = pinned_stream.plan_windows
    pinned_stream.plan_windows = partial(per_tensor_windows, packed=packed)
    try:
        prepare()
        s, kept = _timed(stream_only)
        rate("ours stream alone, a read per tensor", s)
        del kept
        torch.cuda.empty_cache()
        prepare()
        s, model = _timed(lambda: load_transformer(folder, device="cuda", dtype=torch.bfloat16))
        rate("ours load_transformer, a read per tensor", s)
        del model
        torch.cuda.empty_cache()
    finally:
        pinned_stream.plan_windows = packed
    prepare()
    s, model = _timed(lambda: load_transformer(folder, device="cuda", dtype=torch.bfloat16, fp8=True))
    rate("ours load_transformer fp8=True", s)
    del model
    torch.cuda.empty_cache()
    import safetensors.torch

    prepare()
    s, sd = _timed(lambda: [safetensors.torch.load_file(str(f), device="cuda") for f in files])
    rate("safetensors load_file(cuda)", s)
    del sd
    torch.cuda.empty_cache()
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def fst():
            loader = SafeTensorsFileLoader(SingleGroup(), torch.device("cuda:0"), nogds=True)
            loader.add_filenames({0: [str(f) for f in files]})
            fb = loader.copy_files_to_device()
            out = {k: fb.get_tensor(k) for k in fb.key_to_rank_lidx}
            return loader, fb, out

        prepare()
        s, kept = _timed(fst)
        rate("fastsafetensors nogds", s)
        kept[1].close()
        kept[0].close()
        del kept
        torch.cuda.empty_cache()
    except Exception as e:
        row["fastsafetensors nogds"] = f"{type(e).__name__}: {e}"[:200]
    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai():
            out = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_files([str(f) for f in files])
                for name, t in streamer.get_tensors():
                    out[name] = t.to("cuda", non_blocking=True)
            return out

        prepare()
        s, kept = _timed(runai)
        rate("runai-model-streamer", s)
        del kept
        torch.cuda.empty_cache()
    except Exception as e:
        row["runai-model-streamer"] = f"{type(e).__name__}: {e}"[:200]
    row["peak RSS GiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    _emit(args.out, row)


# ------------------------------------------------------------------------------------------------------- cold

DIFFUSERS_SCRIPT = """
import sys, time
t0 = time.perf_counter()
import torch
from diffusers import DiffusionPipeline
t1 = time.perf_counter()
folder, out, steps, guidance = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda")
pipe.set_progress_bar_config(disable=True)
torch.cuda.synchronize(); t2 = time.perf_counter()
kw = dict(height=1024, width=1024, num_inference_steps=steps, guidance_scale=guidance,
          generator=torch.Generator().manual_seed(0))
image = pipe(prompt={prompt!r}, **kw).images[0]  # Flux2KleinPipeline's first argument is the image
torch.cuda.synchronize(); t3 = time.perf_counter()
image.save(out)
t4 = time.perf_counter()
import json
print("STAGES " + json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, call_s=t3 - t2, save_s=t4 - t3,
      gpu_peak_gib=torch.cuda.max_memory_allocated() / 2**30)))
""".replace("{prompt!r}", repr(PROMPT))


def _run(cmd: list[str], env: dict | None = None) -> dict:
    """One fresh process: wall seconds, the child's peak RSS, the stages it printed, its return code."""
    import re

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    row: dict = {"wall_s": round(wall, 2), "rc": rc, "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}
    for line in out.splitlines():
        if line.startswith("STAGES "):  # the diffusers script's
            row.update({k: round(v, 2) for k, v in json.loads(line[7:]).items()})
        if "timings: " in line:  # flux-gen --timings
            for name, value, _unit in re.findall(
                r"([a-z0-9 -]+?) ([0-9]+\.[0-9]+) (s|GiB)", line.split("timings: ")[1]
            ):
                row[name.strip(" ,;").replace(" ", "_")] = float(value)
    if rc:
        row["tail"] = out[-1500:]
    return row


def _same_png(a: Path, b: Path) -> bool | str:
    import numpy as np
    from PIL import Image

    if not (a.is_file() and b.is_file()):
        return "missing"
    return bool(
        np.array_equal(np.asarray(Image.open(a).convert("RGB")), np.asarray(Image.open(b).convert("RGB")))
    )


def _is_assignment(word: str) -> bool:
    """`NAME=VALUE` with an upper-case environment name (flux-gen's options start with `--`)."""
    name, eq, _ = word.partition("=")
    return bool(eq) and name.isidentifier() and name.isupper()


def cmd_cold(args: argparse.Namespace) -> None:
    # Bytecode cached for both, as on a user's machine after the first run (the device's site-packages carry
    # none): one untimed import of each side's modules writes it under PYTHONPYCACHEPREFIX.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPYCACHEPREFIX=str(args.root / "pycache"))
    warm = [
        [sys.executable, "-m", "flux_runtime.cli.gen", "--model", "tiny", "--prompt", "warm", "--out",
         str(args.root / "warm.png"), "--overwrite", "--quiet", "--device", "cuda"],
        [sys.executable, "-c", "import diffusers, transformers; from diffusers import FluxPipeline, Flux2KleinPipeline;"
         "from transformers import CLIPTextModel, T5EncoderModel, Qwen3ForCausalLM, T5TokenizerFast, CLIPTokenizer"],
    ]  # fmt: skip
    for cmd in warm:
        subprocess.run(cmd, env=env, check=False, capture_output=True)
    work = args.root / "png"
    work.mkdir(exist_ok=True)
    script = args.root / "diffusers_script.py"
    script.write_text(DIFFUSERS_SCRIPT)
    flux_gen = [sys.executable, "-m", "flux_runtime.cli.gen"]
    for name, steps, guidance in (("flux1-dev", 28, 3.5), ("klein-4b", 4, 1.0)):
        if name not in args.models:
            continue
        d = args.root / name
        for i in range(args.repeat):
            rows = {}
            ref = work / f"{name}-diffusers.png"
            rows["diffusers script"] = _run(
                [sys.executable, str(script), str(d), str(ref), str(steps), str(guidance)], env
            )
            # the first flux-gen of a machine compiles its Triton kernels (cached on disk): then again
            variants = [("flux-gen", []), ("flux-gen (again)", [])]
            if name == "flux1-dev":
                variants += [("flux-gen --fp8", ["--fp8"]), ("flux-gen --fp8 (again)", ["--fp8"])]
                variants += [(f"flux-gen {' '.join(v)}", v) for v in args.variant]
            for label, words in variants:
                # a variant's NAME=VALUE words set the environment of its process, the rest are options
                extra = [w for w in words if not _is_assignment(w)]
                run_env = dict(env, **dict(w.split("=", 1) for w in words if _is_assignment(w)))
                png = work / f"{name}-{label.replace(' ', '').replace('(again)', '')}.png"
                cmd = [*flux_gen, "--model", str(d), "--prompt", PROMPT, "--width", "1024", "--height", "1024",
                       "--steps", str(steps), "--guidance", str(guidance), "--seed", "0", "--out", str(png),
                       "--overwrite", "--quiet", "--timings", *extra]  # fmt: skip
                rows[label] = _run(cmd, run_env)
                if "--fp8" not in extra:
                    rows[label]["png equal to diffusers"] = _same_png(png, ref)
            base = rows["diffusers script"]["wall_s"]
            for r in rows.values():
                r["x diffusers"] = round(r["wall_s"] / base, 3)
            _emit(args.out, {"cold": name, "run": i, **rows})
        if name == "flux1-dev" and args.prompts:
            pf = work / "prompts.txt"
            pf.write_text("\n".join(f"{PROMPT}, variation {k}" for k in range(args.prompts)) + "\n")
            cmd = [*flux_gen, "--model", str(d), "--prompts", str(pf), "--width", "1024", "--height", "1024",
                   "--steps", str(steps), "--guidance", str(guidance), "--out", str(work / "many"), "--overwrite",
                   "--quiet", "--seed", "0"]  # fmt: skip
            row = _run([*cmd, "--timings"], env)
            images = [row[f"image_{k}"] for k in range(1, args.prompts + 1) if f"image_{k}" in row]
            if len(images) > 2:
                later = sorted(images[1:])[len(images[1:]) // 2]
                row["per image after the first (median)"] = later
                row["image_2 / median later"] = round(images[1] / later, 3)
            _emit(args.out, {"prompts": args.prompts, **row})


FIRST_CALL = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from flux_runtime.pipeline import Pipeline
t3 = time.perf_counter()
folder, steps, guidance = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
pipe = Pipeline.from_pretrained(folder, device="cuda", cuda_graphs=False)
torch.cuda.synchronize(); t4 = time.perf_counter()
row = dict(import_torch=t1 - t0, cuda_context=t2 - t1, import_pipeline=t3 - t2, load=t4 - t3)
profile = sys.argv[4] if len(sys.argv) > 4 else ""
for k in (1, 2):
    marks = []
    def progress(stage, done, total):
        torch.cuda.synchronize(); marks.append((stage, done, time.perf_counter()))
    prof = None
    if profile and k == 1:  # where the first call's extra second goes: Python's own profile of it
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    pipe(PROMPT, height=1024, width=1024, num_steps=steps, guidance=guidance, seed=0,
         progress=progress)
    torch.cuda.synchronize(); end = time.perf_counter()
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof, stream=open(profile, "w")).sort_stats("cumulative").print_stats(60)
        pstats.Stats(prof, stream=open(profile, "a")).sort_stats("tottime").print_stats(40)
    at = {(s, d): x for s, d, x in marks}
    row[f"call{k}"] = dict(
        before_encode=at[("encode", 0)] - t, encode=at[("encode", 1)] - at[("encode", 0)],
        first_step=at[("denoise", 1)] - at[("denoise", 0)],
        other_steps=at[("denoise", steps)] - at[("denoise", 1)],
        decode_and_after=end - at[("denoise", steps)], total=end - t)
print("FIRSTCALL " + json.dumps(row), flush=True)
print("ENDED %.6f" % time.time(), flush=True)
""".replace("PROMPT", repr(PROMPT))


def cmd_first_call(args: argparse.Namespace) -> None:
    """Each model's first call against its second in one fresh process, stage by stage, and its exit time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPYCACHEPREFIX=str(args.root / "pycache"))
    for name, steps, guidance in (("flux1-dev", 28, 3.5), ("klein-4b", 4, 1.0)):
        if name not in args.models:
            continue
        profile = "" if args.profile is None else str(args.profile / f"first_call_{name}.txt")
        cmd = [sys.executable, "-c", FIRST_CALL, str(args.root / name), str(steps), str(guidance), profile]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        exited = time.time()
        row: dict = {"first-call": name, "rc": proc.returncode}
        for line in proc.stdout.splitlines():
            if line.startswith("FIRSTCALL "):
                row.update(json.loads(line[10:]))
            if line.startswith("ENDED "):
                row["exit_s"] = exited - float(line[6:])
        if proc.returncode:
            row["tail"] = (proc.stdout + proc.stderr)[-1500:]
        _emit(args.out, json.loads(json.dumps(row), parse_float=lambda v: round(float(v), 3)))


IMPORT_STAGES = {
    "python alone": "pass",
    "import torch": "import torch",
    "torch + CUDA context": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
    "import triton": "import torch, triton",
    "import flux_runtime.pipeline": "import flux_runtime.pipeline",
    "import flux_runtime.cli.gen": "import flux_runtime.cli.gen",
    "pipeline + transformers (T5, CLIP)": "import flux_runtime.pipeline; from transformers import T5EncoderModel, CLIPTextModel",
    "import diffusers FluxPipeline": "import torch; from diffusers import FluxPipeline",
}


def cmd_imports(args: argparse.Namespace) -> None:
    """Where a fresh process's start goes: each import alone in its own process (twice; bytecode cached, as on a
    user's machine after the first run), then `python -X importtime`'s heaviest modules of the CLI's imports."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(args.root / "pycache"))
    row: dict = {}
    for label, code in IMPORT_STAGES.items():
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode
            walls.append(round(time.perf_counter() - t0, 2))
        row[label] = {"wall_s": walls[1:], "rc": rc}  # the first writes the bytecode
    _emit(args.out, {"imports": row})
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import flux_runtime.cli.gen, flux_runtime.pipeline"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0]), parts[2].rstrip()))
    top = [
        f"{cum / 1e6:.2f} s cumulative, {own / 1e6:.2f} s own: {name}"
        for cum, own, name in sorted(rows)[-30:]
    ]
    _emit(args.out, {"importtime (heaviest 30)": top[::-1]})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("build", "read", "cold", "first-call", "imports"))
    p.add_argument("root", type=Path)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "cold_start.jsonl")
    p.add_argument("--models", default="flux1-dev,klein-4b")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="read: drop the page cache before each reader")
    p.add_argument("--prompts", type=int, default=8, help="cold: images of the --prompts run (0: none)")
    p.add_argument(
        "--profile", type=Path, default=None,
        help="first-call: a folder for cProfile's table of each model's first call (where its extra time goes)",
    )  # fmt: skip
    p.add_argument(
        "--variant", type=lambda v: v.split(), action="append", default=[],
        help="cold: also time FLUX.1-dev's flux-gen with these options (e.g. '--no-cuda-graphs'; NAME=VALUE words "
        "set its environment, e.g. 'FLUX_TEXT_WARMUP=0'); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--ring", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="*",
        default=[(8, 32, 16), (16, 32, 16), (16, 32, 32), (16, 64, 16)],
        help="read: ring shapes THREADSxMIBxSLOTS to time alone",
    )  # fmt: skip
    args = p.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    args.models = args.models.split(",")
    {
        "build": cmd_build,
        "read": cmd_read,
        "cold": cmd_cold,
        "first-call": cmd_first_call,
        "imports": cmd_imports,
    }[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
