"""What `flux-gen` fetches from the Hugging Face Hub: before a run (`fetch`), or alone (`--download-only`).

Only the files the load will read, and only what the local cache lacks: the model, its separate parts
(--vae, --text-encoder, --text-encoder-2), the FLUX.3 prompt upsampler, the LoRAs and the ControlNets. Nothing with --offline
or HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from flux_runtime.cli.gen_checks import controlnets_of, loras_of
from flux_runtime.cli.gen_options import model_parts


def fetch(opts: dict[str, Any]) -> list[Any]:
    """Fetch what the model, its parts, the prompt upsampler, the LoRAs and the ControlNets read and the local cache lacks
    (nothing with --offline or HF_HUB_OFFLINE=1); the repos' plans (`weights.download.RepoPlan`)."""
    from flux_runtime.weights.download import downloads_allowed

    if not downloads_allowed(not opts["offline"]):
        return []
    from flux_runtime.pipeline.downloads import fetch_model

    if opts["quiet"]:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        logging.getLogger("flux_runtime.weights.download").setLevel(logging.INFO)  # "fetching ..." lines
    loras = loras_of(opts)
    return fetch_model(
        opts["model"],
        **model_parts(opts),
        upsampler=False if opts["no_upsample"] else opts["prompt_upsampler"] or True,
        loras=[path for path, _ in loras],
        controlnets=[path for path, _ in controlnets_of(opts)],
    )


def download_only(opts: dict[str, Any]) -> None:
    """--download-only: fetch, then one line per repo (what its plan holds and what was fetched)."""
    from flux_runtime.weights.download import downloads_allowed, size_text

    if not downloads_allowed(not opts["offline"]):
        raise click.ClickException(
            "--download-only fetches from the Hugging Face Hub: drop --offline (and unset HF_HUB_OFFLINE)"
        )
    plans = fetch(opts)
    if not plans:
        click.echo(f"flux-gen: nothing to fetch for {opts['model']} (built in, or local files)", err=True)
    for plan in plans:
        fetched = f"{size_text(plan.to_fetch)} fetched" if plan.missing else "all already in the cache"
        click.echo(f"flux-gen: {plan.describe()}; {fetched}", err=True)
