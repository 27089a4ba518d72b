"""`flux-convert`: convert a FLUX.1, FLUX.2 or FLUX.3 transformer or VAE between the BFL and diffusers layouts,
quantize one to FP8 (`quantize`), or write any of their transformers as a GGUF file (`gguf`).

One click command: parse, call `flux_runtime.weights.convert.convert`, report what was written.
Library errors become one line and exit 1 here, and only here (`--debug` shows the traceback instead).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import cast

import click

from flux_runtime.cli.errors import one_line_errors
from flux_runtime.command_help import (
    DOCS_PAGE,
    FILE,
    FLAG,
    OTHER,
    GroupedCommand,
    option,
    table_groups,
    table_params,
)

# `flux_runtime.weights.convert`'s COMPONENTS and DEFAULT_MAX_SHARD_SIZE (a test keeps them equal), written
# out so that importing this command loads no torch: Ctrl-C while torch loads is then one line too.
COMPONENTS = ("transformer", "vae")
DEFAULT_MAX_SHARD_SIZE = "10GB"
# `flux_runtime.weights.gguf_write.GGUF_TYPES`, written out for the same reason (a test keeps them equal)
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K")


class _Size(click.ParamType):
    """A byte count such as `10GB`, `500MB`, `2GiB` or `1048576`."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from flux_runtime.weights.safetensors_writer import parse_size

        try:
            return parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _human(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# flux-convert's options under their --help headings, in the order it lists them (`command_help.option`)
OPTIONS: dict[str, tuple[click.Option, ...]] = {
    "Writing": (
        option(
            "--max-shard-size", _Size(), "Largest diffusers shard (GB = 10^9 bytes).", DEFAULT_MAX_SHARD_SIZE
        ),
        option("--overwrite", FLAG, "Replace an existing output file or folder."),
    ),
    "GGUF (flux-convert gguf)": (
        option(
            "--type qtype", str, f"gguf: the weights' GGML type: {', '.join(GGUF_TYPES)}.", metavar="TYPE"
        ),
    ),
    "Quantize (flux-convert quantize)": (
        option(
            "--calibration-prompts", FILE, "quantize: one prompt per line [default: a built-in list of 8]."
        ),
        option("--calibration-steps", click.IntRange(1, 1000), "quantize: steps per prompt."),
        option("--calibration-size", click.IntRange(16, 4096), "quantize: image side."),
        option("--device", str, "quantize: where to run the calibration [default: cuda if available]."),
        option("--vae", str, "quantize: the autoencoder of a BFL transformer file."),
        option("--text-encoder", str, "quantize: CLIP-L or the Mistral / Qwen3 model of a BFL file."),
        option("--text-encoder-2", str, "quantize: T5-XXL of a FLUX.1 BFL file."),
    ),
    OTHER: (
        option("--quiet -q", FLAG, "No progress bar, no summary."),
        option("--debug", FLAG, "On an error, show the Python traceback instead of one line."),
    ),
}


@click.command(
    cls=GroupedCommand,
    groups=table_groups(OPTIONS),
    params=[
        click.Argument(["component"], type=click.Choice([*COMPONENTS, "gguf", "quantize"])),
        click.Argument(["src"], type=str),
        click.Argument(["dst"], type=click.Path(path_type=Path)),
        *table_params(OPTIONS),
    ],
    epilog=f"Every option in full: {DOCS_PAGE} (flux-convert).",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 120},
)
def main(
    component: str, src: str, dst: Path, max_shard_size: int, overwrite: bool, quiet: bool, qtype: str | None,
    calibration_prompts: Path | None, calibration_steps: int | None, calibration_size: int | None,
    device: str | None, vae: str | None, text_encoder: str | None, text_encoder_2: str | None, debug: bool,
) -> None:  # fmt: skip
    """Convert the FLUX.1, FLUX.2 or FLUX.3 COMPONENT (transformer or vae) at SRC to the other layout, at DST.

    SRC is a BFL single file (flux1-dev.safetensors, flux2-dev.safetensors, ae.safetensors), a
    diffusers folder or pipeline root, or a cached Hugging Face model id; its family and layout are
    read from its keys. A BFL
    source becomes a diffusers folder DST (config.json, sharded past --max-shard-size); a diffusers
    source becomes one BFL file DST (.safetensors). Values and dtypes are kept bit for bit.

    `flux-convert gguf SRC DST --type Q4_K` writes the FLUX.1 / FLUX.2 / FLUX.3 transformer at SRC as one GGUF
    file DST (BFL names, as city96's files): 2-D weights in TYPE; norms and biases F32; the embedders, the final
    layer and rows that are not whole blocks of TYPE in the source's float type.

    `flux-convert quantize SRC DST` instead writes the bf16 model at SRC (any checkpoint or model name
    `Pipeline.from_pretrained` opens) as a ModelOpt FP8 diffusers folder DST, its static input scales
    calibrated over a few generations (max |activation| per layer).
    """
    logging.basicConfig(level=logging.WARNING, format="flux-convert: %(message)s")
    parts = {"vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2}
    if qtype is not None and component != "gguf":
        raise click.UsageError("--type: only for gguf (it names the GGUF file's weight type)")
    if component == "gguf":
        _refuse_builtin(src)
        with one_line_errors(debug):
            _gguf(src, dst, qtype, overwrite, quiet, parts)
        return
    if component == "quantize":
        with one_line_errors(debug):
            _quantize(
                src, dst, max_shard_size, overwrite, quiet,
                calibration_prompts, calibration_steps, calibration_size, device, parts,
            )  # fmt: skip
        return
    given = [f"--{k.replace('_', '-')}" for k, v in parts.items() if v is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)}: only for quantize (a conversion reads one component)")
    _refuse_builtin(src)
    bar = None
    with one_line_errors(debug):
        try:
            progress = None
            if not quiet and sys.stderr.isatty():
                from tqdm import tqdm

                bar = tqdm(unit="B", unit_scale=True, desc=component, leave=False)
                progress = bar.update
            from flux_runtime.weights.convert import Component, convert

            kind = cast(Component, component)  # click.Choice(COMPONENTS) checked it
            result = convert(
                kind, src, dst, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress
            )
        finally:
            if bar is not None:
                bar.close()
    if not quiet:
        click.echo(
            f"{component}: {result.source_layout} -> {result.target_layout}, "
            f"{result.num_tensors} tensors, {_human(result.total_bytes)}, {len(result.files)} file(s) in {dst}"
        )
        for path in result.files:
            click.echo(f"  {path}")


def _refuse_builtin(src: str) -> None:
    """A built-in model's name is no checkpoint to convert: say where its files are, if it has any."""
    from flux_runtime.weights.builtin import builtin

    model = builtin(src)
    if model is None:
        return
    if not model.trained:
        raise click.ClickException(
            f"{src} is a built-in model of seeded random weights; it has no files to convert"
        )
    raise click.ClickException(
        f"{src} is a built-in model, not a checkpoint; its files (BFL layout) are in {model.folder}"
    )


def _gguf(
    src: str, dst: Path, qtype: str | None, overwrite: bool, quiet: bool, parts: dict[str, str | None]
) -> None:
    """`flux-convert gguf`: write the transformer at `src` as the GGUF file `dst`, its weights in `qtype`."""
    given = [f"--{k.replace('_', '-')}" for k, v in parts.items() if v is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)}: only for quantize (gguf reads one transformer)")
    if qtype is None:
        raise click.ClickException(f"flux-convert gguf needs --type, one of {', '.join(GGUF_TYPES)}")
    from flux_runtime.weights.gguf_write import write_gguf

    bar = None
    try:
        progress = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(unit="B", unit_scale=True, desc="gguf", leave=False)
            progress = bar.update
        result = write_gguf(src, dst, qtype, overwrite=overwrite, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if not quiet:
        types = ", ".join(f"{n} {k}" for k, n in sorted(result.types.items(), key=lambda kv: -kv[1]))
        click.echo(
            f"gguf: {result.source_layout} -> GGUF {qtype.upper()}, {result.num_tensors} tensors ({types}), "
            f"{_human(result.total_bytes)} in {result.path}"
        )


def _quantize(
    src: str, dst: Path, max_shard_size: int, overwrite: bool, quiet: bool,
    prompts_file: Path | None, steps: int | None, size: int | None, device: str | None,
    parts: dict[str, str | None],
) -> None:  # fmt: skip
    from flux_runtime.pipeline.calibrate import quantize_checkpoint, read_prompts

    prompts = read_prompts(prompts_file)
    files = quantize_checkpoint(
        src, dst, prompts=prompts, steps=steps, size=size, device=device,
        max_shard_size=max_shard_size, overwrite=overwrite, **parts,
    )  # fmt: skip
    if not quiet:
        click.echo(
            f"quantize: {src} -> ModelOpt FP8, calibrated on {len(prompts)} prompts, {len(files)} file(s) in {dst}"
        )
        for path in files:
            click.echo(f"  {path}")
