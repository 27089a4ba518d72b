"""The PNG provenance record: one schema for writer and reader, fuzzed; atomic, exclusive PNG writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError
from flux_runtime.pipeline import provenance as provenance_module
from flux_runtime.pipeline.provenance import parse_provenance, provenance, read_provenance, save_png
from tests.fuzz import mutations


def _record() -> dict:
    """A record as flux-gen writes it for a FLUX.2 edit: every required and optional field."""
    info = provenance(
        prompt="a red fox", seed=3, height=32, width=48, steps=2, guidance=4.0, max_sequence_length=48,
        tier="lossless", cuda_graphs=False, model="tiny-flux2", weights="tiny-flux2-seed0",
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    ref = {"path": "/tmp/ref.png", "width": 64, "height": 72, "sha256": "ab" * 32}
    return {**info, "kernels": "off", "reference_images": [ref], "index": 1, "num_images": 2}


def _image() -> Image.Image:
    return Image.new("RGB", (8, 8), (10, 20, 30))


def test_written_record_reads_back(tmp_path: Path) -> None:
    png = tmp_path / "a.png"
    save_png(_image(), png, _record())
    assert read_provenance(png) == json.loads(json.dumps(_record()))


def test_the_writer_refuses_what_the_reader_would(tmp_path: Path) -> None:
    with pytest.raises(FluxError, match="provenance field 'guidance' must be a finite number or null"):
        save_png(_image(), tmp_path / "a.png", {**_record(), "guidance": float("inf")})
    assert list(tmp_path.iterdir()) == []


def test_fuzzed_records_give_a_record_or_a_flux_error() -> None:
    accepted = 0
    for text in mutations(_record(), seed=0, n=400):
        try:
            record = parse_provenance(text, "fuzz.png")
        except FluxError as e:
            assert str(e).startswith("fuzz.png: ") and "\n" not in str(e)
            continue
        accepted += 1
        # what the reader accepts, the fields a replay reads have the right kinds
        assert isinstance(record["height"], int) and record["height"] >= 1
        assert record["dtype"] in ("bfloat16", "float16", "float32")
        assert record["quality"] in ("lossless", "high")
    assert 0 < accepted < 200  # the mutations reach both outcomes


def test_png_that_is_not_one_is_a_flux_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(FluxError, match="cannot read"):
        read_provenance(bad)


def _interrupted_encode(exc: BaseException):
    """A PNG encoder (`provenance.encode_png`) interrupted halfway (as by Ctrl-C or a full disk)."""

    def encode(image: Image.Image, text, level: int) -> bytes:
        raise exc

    return encode


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(28, "No space left on device")], ids=repr)
def test_an_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch, exc) -> None:
    monkeypatch.setattr(provenance_module, "encode_png", _interrupted_encode(exc))
    with pytest.raises(type(exc)):
        save_png(_image(), tmp_path / "a.png", _record())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a fresh interpreter imports torch and transformers (a few seconds)
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_a_killed_write_leaves_no_file(tmp_path: Path) -> None:
    # a writer killed (SIGKILL: no clean-up runs) halfway through the PNG never leaves it at the real path
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from PIL import Image
        from flux_runtime.pipeline import provenance
        from flux_runtime.pipeline.provenance import save_png

        def stuck(image, text, level):
            print("writing", flush=True)
            time.sleep(60)

        provenance.encode_png = stuck
        save_png(Image.new("RGB", (8, 8)), Path({str(tmp_path / "a.png")!r}), {_record()!r})
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (tmp_path / "a.png").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".partial")] == []


def test_two_writers_of_one_path_one_wins_the_other_fails_loudly(tmp_path: Path, monkeypatch) -> None:
    # both finish writing their temporary files before either is put in place
    barrier = threading.Barrier(2, timeout=30)
    real_encode = provenance_module.encode_png

    def encode_then_wait(image: Image.Image, text, level: int) -> bytes | None:
        data = real_encode(image, text, level)
        barrier.wait()
        return data

    monkeypatch.setattr(provenance_module, "encode_png", encode_then_wait)
    out = tmp_path / "a.png"
    results: dict[int, BaseException | None] = {}

    def write(k: int) -> None:
        try:
            save_png(Image.new("RGB", (8, 8), (k, k, k)), out, {**_record(), "seed": k})
            results[k] = None
        except BaseException as e:  # the test reads it below
            results[k] = e

    threads = [threading.Thread(target=write, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in results.values() if e is not None]
    assert len(failed) == 1 and isinstance(failed[0], FluxError), results
    assert "already exists" in str(failed[0])
    winner = next(k for k, e in results.items() if e is None)
    assert read_provenance(out)["seed"] == winner
    with Image.open(out) as im:
        assert im.getpixel((0, 0)) == (winner, winner, winner)
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


def test_overwrite_replaces_in_one_step(tmp_path: Path) -> None:
    out = tmp_path / "a.png"
    save_png(_image(), out, _record())
    with pytest.raises(FluxError, match="already exists"):
        save_png(_image(), out, {**_record(), "seed": 9})
    save_png(_image(), out, {**_record(), "seed": 9}, overwrite=True)
    assert read_provenance(out)["seed"] == 9
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


@pytest.mark.parametrize(
    ("model", "want"),
    [
        ("tiny", ["adaLN projections of all steps in one GEMM"]),  # FLUX.1: the batched modulation
        ("tiny-flux2-random", []),  # FLUX.2 in bf16: nothing to approximate in the denoiser
    ],
)
def test_the_record_lists_what_high_approximated(
    model: str, want: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`approximations` names what `high` changed; a model whose denoiser `high` cannot approximate says so
    (once) instead of passing its lossless steps off as approximate. The high tier is forced on the CPU here
    (it needs CUDA otherwise): the fused kernels then fall back to their references, the batched
    modulation still runs."""
    from flux_runtime.pipeline import Pipeline, core, tiers
    from flux_runtime.pipeline.tiers import RunTier

    pipe = Pipeline.from_pretrained(model, device="cpu", dtype=torch.bfloat16)
    kw = dict(height=32, width=32, num_steps=2, output_type="latent", seed=1)
    assert pipe("a cat", **kw).info["approximations"] == []  # lossless approximates nothing
    monkeypatch.setattr(core, "resolve_tier", lambda q, d, t: RunTier("high", "high"))
    monkeypatch.setattr(tiers, "_warned", set())
    with caplog.at_level("WARNING", logger="flux_runtime.pipeline.tiers"):
        out = pipe("a cat", quality="high", **kw)
    assert out.info["quality"] == "high" and out.info["approximations"] == want
    said = [r.message for r in caplog.records if "has no approximation" in r.message]
    assert len(said) == (0 if want else 1)


def test_high_on_a_model_without_fp8_gemms_records_no_fp8_accumulation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "fast FP8 accumulation" is recorded only where FP8 GEMMs ran: an fp32 model in `high` (forced on the CPU,
    as above) records the batched modulation alone."""
    from flux_runtime.pipeline import Pipeline, core
    from flux_runtime.pipeline.tiers import RunTier

    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    monkeypatch.setattr(core, "resolve_tier", lambda q, d, t: RunTier("high", "high"))
    out = pipe("a cat", quality="high", height=32, width=32, num_steps=2, output_type="latent", seed=1)
    assert out.info["precision"] == "fp32"
    assert out.info["approximations"] == ["adaLN projections of all steps in one GEMM"]
