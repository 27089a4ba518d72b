"""`flux-gen`'s run: plan the calls, check them, load the model once, then make and save each call's images.

The plan (`plan`) is one call, or one per line of `--prompts FILE`, each checked as far as it can be with no
model and given the PNG paths it writes, before the first weights are read. `generate` then fetches what the
cache lacks, refuses the options of another model family, loads, checks what needs the model, and runs the
calls in order, each with the same arguments whether it came from the command line alone or from a line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from flux_runtime.cli import early_cuda
from flux_runtime.cli.gen_checks import (
    check_attention,
    check_attention_heads,
    check_controlnet_files,
    check_early,
    check_flux1_variant,
    check_inputs,
    check_ip_adapter,
    check_lora_files,
    control_modes,
    controlnets_of,
    ip_adapter_of,
    loras_of,
    open_image,
    read_boxes,
    refuse_other_family,
)
from flux_runtime.cli.gen_download import fetch
from flux_runtime.cli.gen_options import DTYPES, OPTION_NAMES, model_parts
from flux_runtime.cli.gen_outputs import output_paths, prompts_paths
from flux_runtime.cli.timings import Stopwatch


@dataclass
class Job:
    """One pipeline call: its options (the command line's, or a --prompts line's over them), the PNGs it
    writes (none on ranks other than 0) and, for a line of --prompts, its FILE:LINE, which starts its errors."""

    opts: dict[str, Any]
    paths: list[Path] = field(default_factory=list)
    where: str | None = None

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Our errors (bad input, files) inside the block, as one line starting with FILE:LINE."""
        if self.where is None:
            yield
            return
        from flux_runtime.cli.errors import is_foreseen, one_line

        try:
            yield
        except click.ClickException as e:
            raise click.ClickException(f"{self.where}: {e.format_message()}") from None
        except Exception as e:
            if not is_foreseen(e):
                raise
            raise click.ClickException(f"{self.where}: {one_line(e)}") from None


class Progress:
    """tqdm bars on stderr for encoding, denoising and decoding (at `position` 1 under --prompts' bar); each event
    also goes to `clock` when given (--timings: `Stopwatch.stage`)."""

    def __init__(
        self,
        enabled: bool,
        position: int | None = None,
        clock: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.enabled, self.position, self.bar, self.stage = enabled, position, None, None
        self.clock = clock

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.clock is not None:
            self.clock(stage, done, total)
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(
                total=total,
                desc=f"{stage:>8}",
                unit="step" if stage == "denoise" else "",
                leave=False,
                position=self.position,
            )
        assert self.bar is not None
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.stage = None, None


def plan(opts: dict[str, Any], main_rank: bool) -> list[Job]:
    """The calls to make, each checked as far as it can be with no model, with the PNG paths they write:
    one call, or one per line of --prompts (every line checked before the first weights are read)."""
    if opts["prompts"] is None:
        check_early(opts)
        n = 1 if opts["replay"] is not None else opts["num_images"]
        job = Job(opts, output_paths(opts["out"], n, opts["seed"], opts["overwrite"]) if main_rank else [])
        check_inputs(opts, set())
        return [job]
    from flux_runtime.cli.prompts_file import read_prompts

    lines = read_prompts(opts["prompts"], OPTION_NAMES)
    jobs, opened = [], set()
    for line in lines:
        job = Job({**opts, **line.options}, where=f"{opts['prompts']}:{line.number}")
        with job.errors():
            check_early(job.opts)
            check_inputs(job.opts, opened)
        jobs.append(job)
    if main_rank:
        files = [line.file_names(job.opts["num_images"]) for line, job in zip(lines, jobs, strict=True)]
        for job, paths in zip(jobs, prompts_paths(opts["out"], files, opts["overwrite"]), strict=True):
            job.paths = paths
    return jobs


def use_cuda_graphs(opts: dict[str, Any], jobs: list[Job]) -> bool:
    """Whether the denoiser replays CUDA graphs: as --cuda-graphs / --no-cuda-graphs say, else when the process
    makes several calls or a call runs a step cache.

    Measured on the H200 (FLUX.1-dev, 28 steps, a fresh process each): one uncached image came out 0.3 s faster
    eagerly (the capture costs more than one image's replays save), but one FP8 `high` image with the default
    step cache took 3.65 s in graphs against 5.05 s eagerly: the cache decides each step on the host after the
    probe, which eagerly leaves the GPU idle while the rest of the step is launched, and under graphs costs one
    replay."""
    if opts["cuda_graphs"] or opts["no_cuda_graphs"]:
        return bool(opts["cuda_graphs"])
    return len(jobs) > 1 or any(job.opts.get("cache") is not None for job in jobs)


def generate(opts: dict[str, Any]) -> None:
    """Check every call, load the model once, then run and save each call; as one rank of a parallel run
    (`opts["_rank"]`), only rank 0 shows progress and saves."""
    import torch

    rank = opts.get("_rank")
    if early_cuda.started():
        # one process on a GPU: the load's pinned ring (and torch's CUDA start-up) made while our modules import
        from flux_runtime.weights import pinned_stream

        pinned_stream.prepare_ring()
    from flux_runtime.pipeline import Pipeline
    from flux_runtime.pipeline.checks import check_device
    from flux_runtime.pipeline.sources import model_family

    watch: Stopwatch = opts["_watch"]
    main_rank = rank in (None, 0)
    jobs = plan(opts, main_rank)
    loras = loras_of(opts)
    device = check_device(opts["device"])
    replaying = opts["replay"] is not None
    dtype_name = opts["dtype"] or (
        "bf16" if device.type == "cuda" or opts["fp8"] or opts["fp8_text"] else "fp32"
    )
    check_attention(opts, device, getattr(torch, DTYPES[dtype_name]))
    if rank is None:  # the ranks of a parallel run read the cache (`--gpus` fetched before starting them)
        with watch.lap("download"):
            fetch(opts)
    check_lora_files(loras)
    controlnets = controlnets_of(opts)
    check_controlnet_files(controlnets)
    ip = ip_adapter_of(opts)
    check_ip_adapter(ip)

    # options of another family fail now, before anything loads
    family = model_family(opts["model"], **model_parts(opts))
    for job in jobs:
        with job.errors():
            refuse_other_family(job.opts, family)

    # torch, the pipeline and the checks before the load
    watch.laps["imports"] = time.perf_counter() - watch.start - sum(watch.laps.values())
    with watch.lap("load"):
        early_cuda.join()  # the context started beside the imports (`early_cuda`), if one was
        pipe = Pipeline.from_pretrained(
            opts["model"],
            device=device,
            dtype=getattr(torch, DTYPES[dtype_name]),
            quality=opts["quality"],
            **model_parts(opts),
            cuda_graphs=use_cuda_graphs(opts, jobs),
            offload_text_encoders=opts["offload_text_encoders"],
            fp8=opts["fp8"],
            # --fp8 covers the text encoders; a replay takes exactly what the record says
            fp8_text=opts["fp8_text"] if replaying else opts["fp8"] or opts["fp8_text"],
            # a parallel run keeps every model resident (memory plans are for one GPU)
            memory=opts["memory"] if rank is None else "auto",
            parallel=None if rank is None else opts["gpus"],
            download=False,  # fetched above
            controlnet=[path for path, _ in controlnets] or None,
            redux=opts["redux"],  # FLUX.1 Redux (refused above for other families)
            redux_image_encoder=opts["redux_image_encoder"],
        )
    if not opts["quiet"] and main_rank:
        click.echo(f"flux-gen: {pipe.memory_plan.describe()}", err=True)
    pipe.vae_tile = opts["vae_tile"]
    check_attention_heads(opts, pipe.transformer.config.head_dim)
    with watch.lap("load"):
        for path, scale in loras:
            pipe.load_lora(path, scale=scale)
        if ip is not None:
            pipe.load_ip_adapter(ip[0], ip[1], image_encoder=ip[2])
    if main_rank and replaying:
        _replay_warnings(opts, pipe.weights_id)
    if pipe.family == "flux3" and (
        opts["prompt_upsampler"] is not None or opts["upsampler_prompts"] is not None
    ):
        source = opts["prompt_upsampler"] or pipe.prompt_upsampler.source
        pipe.set_prompt_upsampler(source, prompts=opts["upsampler_prompts"])
    if pipe.family == "flux1":
        for job in jobs:  # every line's FLUX.1 variant checks, before the first image is drawn
            with job.errors():
                check_flux1_variant(pipe, job.opts)
    from flux_runtime.kernels.attention_backends import attention_backend

    with attention_backend(opts["attention"]):  # --attention, for this command's calls only
        _run(pipe, jobs, opts, rank)


def _replay_warnings(opts: dict[str, Any], weights_id: Any) -> None:
    """What may keep a replay's pixels from the recorded ones: other weights, or a batch flux-serve made."""
    if opts["_replay_weights"] not in (None, weights_id):
        click.echo(
            f"flux-gen: warning: the weights differ from the recorded ones ({opts['_replay_weights']}); "
            "the image will differ",
            err=True,
        )
    if (opts["_served_batch"] or 1) > 1:
        click.echo(
            f"flux-gen: warning: this image was served in a batch of {opts['_served_batch']} images; the "
            "replay runs it alone and a batch's size changes the GEMMs' rounding, so pixels may differ slightly",
            err=True,
        )


def _run(pipe: Any, jobs: list[Job], opts: dict[str, Any], rank: int | None) -> None:
    """Each call in turn, timed, with progress bars on a terminal; rank 0 (or the only process) saves."""
    watch: Stopwatch = opts["_watch"]
    main_rank = rank in (None, 0)
    shown = main_rank and not opts["quiet"] and sys.stderr.isatty()
    many = opts["prompts"] is not None
    progress = Progress(shown, position=1 if many else None, clock=watch.stage if opts["timings"] else None)
    file_bar = None
    if shown and many:
        from tqdm import tqdm

        file_bar = tqdm(total=len(jobs), desc=" prompts", unit="prompt")
    try:
        for job in jobs:
            # errors of a parallel run pass unprefixed: gen_ranks.rank_errors tells a lost peer by its type
            with job.errors() if rank is None else nullcontext():
                with watch.lap(f"image {sum(k.startswith('image') for k in watch.laps) + 1}"):
                    out = _call(pipe, job.opts, progress)
                progress.close()
                if main_rank:  # rank 0 writes the images
                    with watch.lap("save"):
                        saved = _save(job, out)
                    for path in saved:
                        (file_bar.write if file_bar is not None else click.echo)(str(path))
            if file_bar is not None:
                file_bar.update()
    finally:
        if file_bar is not None:
            file_bar.close()


def _call(pipe: Any, opts: dict[str, Any], progress: Progress) -> Any:
    """One pipeline call with `opts`: the same arguments whether they came from the command line alone or
    from a line of --prompts, so a line's pixels are those of the same options run alone."""

    images_in = [open_image(p.resolve()) for p in opts["image"]]
    common = dict(
        height=opts["height"],
        width=opts["width"],
        num_steps=opts["steps"],
        guidance=opts["guidance"],
        seed=opts["seed"],
        max_sequence_length=opts["max_sequence_length"],
        num_images_per_prompt=opts["_replay_batch"] if opts["replay"] is not None else opts["num_images"],
        progress=progress,
        cache=opts["cache"] or "off",
    )
    if pipe.family == "flux3":
        return pipe(
            opts["prompt"],
            image=images_in or None,
            upsample=False if opts["no_upsample"] else None,
            upsampled_prompt=opts.get("_upsampled_prompt"),
            boxes=read_boxes(opts["boxes"]),
            **common,
        )
    if pipe.family == "flux2":
        return pipe(opts["prompt"], image=images_in or None, **common)
    flux1_inputs: dict[str, Any] = {}
    if opts["mask"] is not None:
        flux1_inputs["mask_image"] = open_image(opts["mask"].resolve())
    controls = [open_image(p.resolve()) for p in opts["control_image"]]
    if pipe.controlnets:
        flux1_inputs.update(
            control_image=controls,
            controlnet_conditioning_scale=[scale for _, scale in controlnets_of(opts)],
            control_mode=control_modes(opts),
            control_guidance_start=(opts["control_range"] or (0.0, 1.0))[0],
            control_guidance_end=(opts["control_range"] or (0.0, 1.0))[1],
        )
    elif controls:  # a Depth / Canny model's
        flux1_inputs["control_image"] = controls[0]
    for name, opt in (("ip_adapter_image", "ip_image"), ("negative_ip_adapter_image", "negative_ip_image")):
        if opts[opt] is not None:
            flux1_inputs[name] = open_image(opts[opt].resolve())
    if pipe.variant == "kontext":
        flux1_inputs.update(max_area=opts["max_area"], auto_resize=not opts["no_auto_resize"])
    if opts["redux"] is not None:  # every --image is a Redux image
        flux1_inputs.update(
            prompt_embeds_scale=opts["redux_scale"], pooled_prompt_embeds_scale=opts["redux_pooled_scale"]
        )
        return pipe(opts["prompt"], image=images_in, **flux1_inputs, **common)
    return pipe(
        opts["prompt"],
        image=images_in[0] if images_in else None,
        strength=opts["strength"],
        negative_prompt=opts["negative_prompt"],
        true_cfg_scale=opts["true_cfg"],
        **flux1_inputs,
        **common,
    )


def _save(job: Job, out: Any) -> list[Path]:
    """Write the call's images to `job.paths`, each with its provenance and its place in the call's batch."""
    from flux_runtime.pipeline.provenance import save_png

    opts = job.opts
    replaying = opts["replay"] is not None
    num_per_prompt = opts["_replay_batch"] if replaying else opts["num_images"]
    images = out.images[opts["_replay_index"] : opts["_replay_index"] + 1] if replaying else out.images
    for i, (image, path) in enumerate(zip(images, job.paths, strict=True)):
        info = {**out.info, "index": opts["_replay_index"] if replaying else i, "num_images": num_per_prompt}
        save_png(image, path, info, overwrite=opts["overwrite"])
    return job.paths
