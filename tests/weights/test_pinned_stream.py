"""The read-ahead stream behind every GPU load: the same bytes as a plain read, whatever its shape.

On the CPU the stream runs the same planning, threads, ring and ordering with an unpinned ring and
immediate copies (`pinned_stream.stream_on_cpu`); the GPU tests run the pinned ring and side-stream copies.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime.weights import pinned_stream
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.pinned_stream import DeviceStream, PinnedRing, RingShape, Span
from flux_runtime.weights.safetensors_io import TensorSource, read_state_dict
from flux_runtime.weights.transformer import load_transformer
from flux_runtime.weights.vae import load_vae
from tests.flux1_fixtures import make_diffusers_transformer, save_bfl, save_diffusers
from tests.flux2_fixtures import make_diffusers_flux2
from tests.flux2_fixtures import save_bfl as save_bfl_flux2
from tests.flux3_fixtures import make_diffusers_flux3
from tests.flux3_fixtures import save_bfl as save_bfl_flux3
from tests.fp8_fixtures import fp8_params, write_modelopt
from tests.weights.vae_fixtures import make_diffusers_vae, save_bfl_vae, save_diffusers_vae


def _tensors(seed: int, sizes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    out = {}
    for i, (k, shape) in enumerate(sizes.items()):
        x = torch.randn(shape, generator=gen) * 100
        out[k] = x.to(dtypes[i % len(dtypes)])
    return out


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("stream")
    a = _tensors(0, {"a.big": (300, 7), "a.small": (3,), "a.empty": (0, 5), "a.scalar": (), "a.mid": (64, 9)})
    b = _tensors(1, {"b.x": (129,), "b.y": (17, 33), "b.z": (1,)})
    save_file(a, str(folder / "one.safetensors"))
    save_file(b, str(folder / "two.safetensors"))
    return [folder / "one.safetensors", folder / "two.safetensors"], {**a, **b}


def _spans(src: TensorSource, keys: list[str]) -> list[Span]:
    return [Span(k, src.path_of(k), src._spans[k][0], src._spans[k][1] - src._spans[k][0]) for k in keys]


@pytest.mark.parametrize(
    ("threads", "slots", "buffer"),
    [(1, 2, 1 << 20), (1, 2, 64), (3, 4, 100), (8, 3, 7), (2, 16, 4096)],
)
def test_stream_gives_each_tensors_bytes_for_any_ring(
    two_files, threads: int, slots: int, buffer: int
) -> None:
    """1 to 8 readers, a ring smaller than one tensor (tensors spanning many buffers), two files."""
    files, want = two_files
    src = TensorSource(files)
    order = ["b.y", "a.big", "a.empty", "a.scalar", "b.x", "a.small", "a.mid", "b.z"]
    ring = PinnedRing(RingShape(threads, slots, buffer), pinned=False)
    stream = DeviceStream(_spans(src, order), torch.device("cpu"), ring)
    try:
        for k in order:
            assert stream.has(k)
            raw = stream.take(k)
            assert not stream.has(k)
            got = raw.view(want[k].dtype).reshape(want[k].shape)
            assert torch.equal(got, want[k]), k
    finally:
        stream.close()


def test_keys_taken_out_of_order_and_unplanned_keys(two_files, monkeypatch: pytest.MonkeyPatch) -> None:
    files, want = two_files
    monkeypatch.setattr(pinned_stream, "stream_on_cpu", True)
    monkeypatch.setenv("FLUX_LOAD_BUFFER_MB", "1")
    src = TensorSource(files)
    with src.streaming(["a.small", "b.x", "a.big"], "cpu"):
        assert torch.equal(src.get("a.big", "cpu"), want["a.big"])  # later key first: earlier ones held
        assert torch.equal(src.get("a.small", "cpu", torch.float64), want["a.small"].double())
        assert torch.equal(src.get("b.y", "cpu"), want["b.y"])  # not planned: a plain read
        assert torch.equal(src.get("a.big", "cpu"), want["a.big"])  # taken twice: a plain read
    assert src._stream is None


def test_state_dict_in_file_order(two_files, monkeypatch: pytest.MonkeyPatch) -> None:
    files, want = two_files
    monkeypatch.setattr(pinned_stream, "stream_on_cpu", True)
    sd = read_state_dict(files, "cpu")
    src = TensorSource(files)
    assert list(sd) == sorted(want, key=lambda k: (files.index(src.path_of(k)), src._spans[k][0]))
    for k, v in want.items():
        assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype


def test_a_file_shorter_than_its_header_names_file_and_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned_stream, "stream_on_cpu", True)
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.ones(1000), "v": torch.ones(10)}, str(path))
    src = TensorSource([path])  # header checked against the full file
    os.truncate(path, os.path.getsize(path) - 100)
    with (
        pytest.raises(WeightsError, match=r"cut\.safetensors: cannot read 'w'.*shorter than its header"),
        src.streaming(["v", "w"], "cpu"),
    ):
        src.get("v", "cpu")
        src.get("w", "cpu")


def test_a_damaged_header_fails_before_any_stream(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    data = bytearray(path.read_bytes())
    data[8] = ord("#")  # the JSON header's opening brace
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"bad\.safetensors: not a safetensors file"):
        read_state_dict([path], "cpu")


def test_ring_environment_overrides_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX_LOAD_THREADS", "3")
    monkeypatch.setenv("FLUX_LOAD_BUFFER_MB", "2")
    monkeypatch.setenv("FLUX_LOAD_SLOTS", "5")
    shape = RingShape.default()
    assert (shape.threads, shape.slots, shape.host_bytes) == (3, 5, 10 << 20)
    monkeypatch.setenv("FLUX_LOAD_THREADS", "zero")
    with pytest.raises(WeightsError, match="FLUX_LOAD_THREADS='zero' must be a whole number"):
        RingShape.default()
    monkeypatch.setenv("FLUX_LOAD_THREADS", "0")
    with pytest.raises(WeightsError, match="FLUX_LOAD_THREADS=0 must be at least 1"):
        RingShape.default()


@pytest.fixture
def takes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Streaming onto the CPU, small buffers, three readers; the keys the stream served, in order."""
    monkeypatch.setattr(pinned_stream, "stream_on_cpu", True)
    monkeypatch.setenv("FLUX_LOAD_BUFFER_MB", "1")
    monkeypatch.setenv("FLUX_LOAD_THREADS", "3")
    served: list[str] = []
    take = DeviceStream.take

    def counted(self: DeviceStream, key: str) -> torch.Tensor:
        served.append(key)
        return take(self, key)

    monkeypatch.setattr(DeviceStream, "take", counted)
    return served


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert getattr(a, "precision", None) == getattr(b, "precision", None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint of each layout the loaders stream: FLUX.1 BFL and diffusers, FLUX.2, FLUX.3, both VAEs."""
    root = tmp_path_factory.mktemp("layouts")
    flux1 = make_diffusers_transformer(guidance=True, seed=3)
    return {
        "flux1-bfl": save_bfl(flux1, root / "flux1.safetensors", prefix="model.diffusion_model."),
        "flux1-diffusers": save_diffusers(flux1, root / "flux1"),
        "flux2-bfl": save_bfl_flux2(make_diffusers_flux2(guidance=True, seed=4), root / "flux2.safetensors"),
        "flux3-bfl": save_bfl_flux3(make_diffusers_flux3(flow_map=False, seed=5), root / "flux3.safetensors"),
        "fp8-modelopt": write_modelopt(flux1, fp8_params(flux1, None), root / "fp8"),
    }


@pytest.mark.parametrize("name", ["flux1-bfl", "flux1-diffusers", "flux2-bfl", "flux3-bfl", "fp8-modelopt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_transformer_layout_loads_the_same_bits_streamed(
    checkpoints, name: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    if name == "fp8-modelopt" and dtype != torch.bfloat16:
        pytest.skip("FP8 checkpoints compute in bf16")
    plain = load_transformer(checkpoints[name], dtype=dtype)
    request.getfixturevalue("takes")
    streamed = load_transformer(checkpoints[name], dtype=dtype)
    _same(streamed, plain)
    served = request.getfixturevalue("takes")
    assert (
        len(served) >= len(plain.state_dict()) // 2
    )  # FP8: the weights streamed, their scales read as asked


def test_quantize_at_load_streamed_is_unchanged(checkpoints, request: pytest.FixtureRequest) -> None:
    from flux_runtime.weights.fp8 import check_fp8_gemm

    if check_fp8_gemm(torch.device("cpu")) is not None:
        pytest.skip("no FP8 GEMM on this device")
    plain = load_transformer(checkpoints["flux1-diffusers"], fp8=True)
    served = request.getfixturevalue("takes")
    _same(load_transformer(checkpoints["flux1-diffusers"], fp8=True), plain)
    assert served


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_vae_streamed_is_unchanged(tmp_path: Path, layout: str, request: pytest.FixtureRequest) -> None:
    vae = make_diffusers_vae(seed=6)
    path = (
        save_bfl_vae(vae, tmp_path / "ae.safetensors")
        if layout == "bfl"
        else save_diffusers_vae(vae, tmp_path / "vae")
    )
    plain = load_vae(path, dtype=torch.bfloat16)
    served = request.getfixturevalue("takes")
    _same(load_vae(path, dtype=torch.bfloat16), plain)
    assert len(served) == len(plain.state_dict())


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("buffer", [64, 1 << 20])
def test_pinned_stream_on_the_gpu_gives_the_files_bytes(two_files, buffer: int) -> None:
    files, want = two_files
    src = TensorSource(files)
    order = list(reversed(src.keys()))
    ring = PinnedRing(RingShape(4, 3, buffer), pinned=True)
    stream = DeviceStream(_spans(src, order), torch.device("cuda", torch.cuda.current_device()), ring)
    try:
        for k in order:
            got = stream.take(k).view(want[k].dtype).reshape(want[k].shape)
            assert got.is_cuda and torch.equal(got.cpu(), want[k]), k
    finally:
        stream.close()
        ring.release()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux1-bfl", "flux1-diffusers", "flux2-bfl", "flux3-bfl", "fp8-modelopt"])
def test_gpu_load_through_the_ring_equals_the_cpu_load(checkpoints, name: str) -> None:
    """The GPU load (pinned ring, side-stream copies, on-GPU casts, merges and FP8) equals the CPU one moved."""
    cpu = load_transformer(checkpoints[name], dtype=torch.bfloat16)
    with pinned_stream.keep_ring():
        gpu = load_transformer(checkpoints[name], dtype=torch.bfloat16, device="cuda")
        assert pinned_stream._kept[0] is not None
    assert pinned_stream._kept[0] is None
    for (k, a), (_, b) in zip(gpu.state_dict().items(), cpu.state_dict().items(), strict=True):
        assert a.is_cuda and a.dtype == b.dtype and torch.equal(a.cpu(), b), k


@pytest.mark.gpu
def test_gpu_quantize_at_load_through_the_ring_is_unchanged(checkpoints) -> None:
    path = checkpoints["flux1-diffusers"]
    streamed = load_transformer(path, dtype=torch.bfloat16, device="cuda", fp8=True)
    # the same load with one tensor at a time: every key outside the plan
    from flux_runtime.weights.safetensors_io import TensorSource as Src

    orig = Src.streaming
    try:
        Src.streaming = lambda self, keys, device: orig(self, [], device)  # type: ignore[method-assign]
        plain = load_transformer(path, dtype=torch.bfloat16, device="cuda", fp8=True)
    finally:
        Src.streaming = orig  # type: ignore[method-assign]
    _same(streamed, plain)


@pytest.mark.gpu
def test_a_text_encoder_streamed_onto_the_gpu_keeps_the_streamed_tensors(tmp_path: Path, monkeypatch) -> None:
    """transformers builds the model around the streamed GPU tensors (device_map): no copy back to the host,
    no second GPU copy; the parameters equal a load from the folder moved to the GPU."""
    from transformers import T5Config, T5EncoderModel

    from flux_runtime.text import hf_weights

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    T5EncoderModel(config).to(torch.bfloat16).save_pretrained(tmp_path)
    streamed: list[int] = []
    read = hf_weights.read_state_dict

    def recording(files, device):
        state = read(files, device)
        streamed.extend(t.data_ptr() for t in state.values())
        return state

    monkeypatch.setattr(hf_weights, "read_state_dict", recording)
    model, info = hf_weights.load_pretrained(T5EncoderModel, tmp_path, torch.bfloat16, "cuda")
    assert not info["missing_keys"] and streamed
    params = dict(model.named_parameters())
    assert all(p.is_cuda for p in params.values())
    assert {p.data_ptr() for p in params.values()} <= set(streamed)
    plain = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, p in plain.named_parameters():
        assert torch.equal(params[name].cpu(), p), name


def _window_case(
    sizes: list[int], buffer: int, order: list[int] | None = None
) -> tuple[list, list, list[Span]]:
    """Spans of `sizes` bytes back to back in one file (taken in `order`), and their windows."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    spans = [Span(f"t{i}", Path("f"), offsets[i], n) for i, n in enumerate(sizes)]
    plan = [spans[i] for i in (order or range(len(sizes)))]
    windows, pieces = pinned_stream.plan_windows(plan, buffer)
    return windows, pieces, plan


def test_small_tensors_back_to_back_share_full_buffers() -> None:
    sizes = [4, 4, 100, 4, 4, 4, 50]  # 170 bytes, a 64-byte buffer: 3 reads, not one per tensor or more
    windows, pieces, _ = _window_case(sizes, 64)
    assert [(w.offset, w.length) for w in windows] == [(0, 64), (64, 64), (128, 42)]
    assert windows[0].keys == ((0, "t0"), (4, "t1"), (8, "t2"))
    assert [(p.window, p.start, p.length, p.into) for p in pieces[2]] == [(0, 8, 56, 0), (1, 0, 44, 56)]


def test_every_byte_lands_once_and_each_read_frees_its_buffer_once() -> None:
    gen = torch.Generator().manual_seed(0)
    for case in range(60):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        sizes = [int(v) for v in torch.randint(0, 200, (n,), generator=gen)]
        buffer = int(torch.randint(1, 90, (1,), generator=gen))
        order = torch.randperm(n, generator=gen).tolist() if case % 2 else None
        windows, pieces, plan = _window_case(sizes, buffer, order)
        assert all(0 < w.length <= buffer for w in windows)
        for span, mine in zip(plan, pieces, strict=True):
            assert sum(p.length for p in mine) == span.nbytes
            for p in mine:  # the piece reads exactly the tensor's own bytes
                assert windows[p.window].offset + p.start == span.offset + p.into
                assert p.start + p.length <= windows[p.window].length
        flat = [p for mine in pieces for p in mine]
        assert [p.window for p in flat] == sorted(p.window for p in flat)  # reads used in order
        assert sorted(p.window for p in flat if p.last) == list(range(len(windows)))
        for w in range(len(windows)):  # the freeing piece is the window's last in issue order
            assert [p for p in flat if p.window == w][-1].last


def test_a_jump_in_the_file_or_order_starts_a_new_read() -> None:
    windows, _, _ = _window_case([10, 10, 10], 1000, order=[0, 2, 1])
    assert [(w.offset, w.length) for w in windows] == [(0, 10), (20, 10), (10, 10)]
    two = [Span("a", Path("f"), 0, 10), Span("b", Path("g"), 10, 10)]
    assert len(pinned_stream.plan_windows(two, 1000)[0]) == 2


def test_a_prepared_ring_serves_the_next_scope_of_its_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare_ring`'s ring (made on its thread) is the next scope's, once; another shape is not taken."""
    monkeypatch.setattr(pinned_stream, "_spare", [])
    monkeypatch.setattr(pinned_stream, "_preparing", [])
    monkeypatch.setattr(pinned_stream, "PinnedRing", lambda shape, pinned=True: _FakeRing(shape))
    monkeypatch.setenv("FLUX_LOAD_BUFFER_MB", "1")
    assert pinned_stream.prepare_ring()
    assert not pinned_stream.prepare_ring()  # once per process
    made = pinned_stream._take_spare(RingShape.default())
    assert isinstance(made, _FakeRing) and made.shape == RingShape.default()
    pinned_stream._spare.append(made)
    with pinned_stream.keep_ring(), pinned_stream.ring() as r:
        assert r is made
    assert made.released and pinned_stream._spare == []
    other = _FakeRing(RingShape(1, 2, 64))
    pinned_stream._spare.append(other)
    assert pinned_stream._take_spare(RingShape.default()) is None and other.released


def test_a_ring_that_cannot_be_made_ahead_leaves_the_load_to_make_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(shape: RingShape, pinned: bool = True) -> None:
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(pinned_stream, "_spare", [])
    monkeypatch.setattr(pinned_stream, "_preparing", [])
    monkeypatch.setattr(pinned_stream, "PinnedRing", fail)
    assert pinned_stream.prepare_ring()
    assert pinned_stream._take_spare(RingShape.default()) is None


class _FakeRing:
    def __init__(self, shape: RingShape) -> None:
        self.shape, self.released = shape, False

    def release(self) -> None:
        self.released = True
