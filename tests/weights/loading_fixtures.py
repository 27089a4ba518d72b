"""What the loading tests of every model share: loads compared bit for bit, a loaded model's state, checkpoints
edited to break them, a Hugging Face cache entry laid out by hand, and the checks the FLUX.1 and FLUX.2
autoencoders' tests make alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime import WeightsError, load_transformer, load_vae
from tests.weights.vae_fixtures import make_image, save_diffusers_vae

# A commit hash for the hand-made cache entries.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def dit_fixtures(make: Callable[[], object], save_bfl, name: str):
    """The `dev_model` (`make()`, once per module) and `bfl_file` (saved by `save_bfl` as `name`) fixtures of a
    transformer's loading tests: `dev_model, bfl_file = dit_fixtures(...)` in the test module."""

    @pytest.fixture(scope="module")
    def dev_model():
        return make()

    @pytest.fixture
    def bfl_file(tmp_path, dev_model):
        return save_bfl(dev_model, tmp_path / name)

    return dev_model, bfl_file


def vae_fixtures(make: Callable[[], object], save_bfl):
    """The `model` (`make()`, once per module), `bfl_file` (its `ae.safetensors`, saved by `save_bfl`) and `folder`
    (its vae/ folder) fixtures of an autoencoder's loading tests: `model, bfl_file, folder = vae_fixtures(...)`."""

    @pytest.fixture(scope="module")
    def model():
        return make()

    @pytest.fixture
    def bfl_file(tmp_path, model):
        return save_bfl(model, tmp_path / "ae.safetensors")

    @pytest.fixture
    def folder(tmp_path, model):
        return save_diffusers_vae(model, tmp_path / "vae")

    return model, bfl_file, folder


def same_weights(a, b) -> bool:
    """The two models hold the same tensors under the same names, bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def assert_ready(model, dtype: torch.dtype, buffers: bool = False) -> None:
    """Every parameter (and with `buffers`, every buffer) of `model` in `dtype`, none left on the meta device, no
    gradients, eval mode."""
    tensors = [*model.parameters(), *(model.buffers() if buffers else ())]
    assert {t.dtype for t in tensors} == {dtype}
    assert not any(t.is_meta for t in tensors)
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def edited(src: Path, edit: Callable[[dict[str, torch.Tensor]], object], dst: Path | None = None) -> Path:
    """The safetensors file `src` with `edit` applied to its tensors, written to `dst` (default: over `src`)."""
    sd = load_file(str(src))
    edit(sd)
    dst = src if dst is None else dst
    save_file(sd, str(dst))
    return dst


def sharded(model, folder: Path, max_shard_size: str) -> Path:
    """`model` saved by diffusers into `folder` in shards of at most `max_shard_size`, with their index."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folder


def pipeline_root(save: Callable[[object, Path], Path], model, root: Path, component: str) -> Path:
    """A diffusers pipeline folder `root` holding `model` as its `component/` (saved by `save`)."""
    save(model, root / component)
    (root / "model_index.json").write_text("{}")
    return root


def dits_every_way(tmp_path: Path, model, bfl_file: Path, fixtures: ModuleType) -> list:
    """The diffusers transformer `model` loaded (fp32) from its BFL file, a ComfyUI-prefixed one, a pipeline root
    and its transformer/ folder (`fixtures` writes them: a `flux{1,2}_fixtures` module): the same weights each way."""
    prefixed = fixtures.save_bfl(model, tmp_path / "comfy.safetensors", "model.diffusion_model.")
    root = pipeline_root(fixtures.save_diffusers, model, tmp_path / "pipe", "transformer")
    loaded = [
        load_transformer(p, dtype=torch.float32) for p in (bfl_file, prefixed, root, root / "transformer")
    ]
    assert all(same_weights(loaded[0], other) for other in loaded[1:])
    return loaded


def cached_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in a Hugging Face cache under `tmp_path` laid out by hand, as `hf download`
    leaves it (its `main` ref set), the cache made the one an offline load reads."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / COMMIT


def vaes_every_way(tmp_path: Path, model, bfl_file: Path, folder: Path, save_bfl, dit_key: str):
    """The diffusers autoencoder `model` loaded (fp32) from its BFL file (`save_bfl` writes them), its vae/
    `folder`, a pipeline root, a BFL repo root (ae.safetensors beside a transformer file holding `dit_key`) and an
    all-in-one file (the VAE under `vae.`, another component beside it): the same weights each way. Returns the BFL
    file's model."""
    from_bfl = load_vae(bfl_file, dtype=torch.float32)
    repo = tmp_path / "repo"
    repo.mkdir()
    save_bfl(model, repo / "ae.safetensors")
    save_file({dit_key: torch.zeros(2, 2)}, str(repo / "flux-dev.safetensors"))
    other = {"model.diffusion_model.img_in.weight": torch.zeros(2, 2)}
    combined = save_bfl(model, tmp_path / "all.safetensors", prefix="vae.", extra=other)
    for path in (folder, pipeline_root(save_diffusers_vae, model, tmp_path / "pipe", "vae"), repo, combined):
        assert same_weights(from_bfl, load_vae(path, dtype=torch.float32))
    return from_bfl


def same_codec(ours, ref, x: torch.Tensor) -> torch.Tensor:
    """`ours` encodes `x` to diffusers' `ref`'s latents (their mode) and decodes those to `ref`'s image, bit for
    bit. Returns the latents."""
    z = ours.encode(x)
    assert torch.equal(z, ref.encode(x).latent_dist.mode())
    assert torch.equal(ours.decode(z), ref.decode(z).sample)
    return z


def bfl_vae_needs_config(tmp_path: Path, model, save_bfl, ref_cls, preset) -> Path:
    """A BFL file of `model` (widths 16, 32 in 8 groups) states no groups: the 32 the loader assumes do not divide
    16 channels, so config= must say (`preset` with the file's shape); so told, the file encodes as diffusers'
    `ref_cls` reads the model, and a config of another shape is refused. Returns the file."""
    path = save_bfl(model, tmp_path / "ae.safetensors")
    with pytest.raises(WeightsError, match="not divisible by norm_num_groups 32; pass config="):
        load_vae(path)
    cfg = replace(preset, ch=16, ch_mult=(1, 2), norm_num_groups=8)
    ours = load_vae(path, dtype=torch.float32, config=cfg)
    ref = ref_cls.from_pretrained(save_diffusers_vae(model, tmp_path / "vae")).eval()
    x = make_image(1, 8, 12, torch.float32)
    assert torch.equal(ours.encode(x), ref.encode(x).latent_dist.mode())
    with pytest.raises(WeightsError, match=r"ch_mult: checkpoint \(1, 2\), config \(1, 1\)"):
        load_vae(path, config=replace(cfg, ch_mult=(1, 1)))
    return path


def edit_config(folder: Path, edit: dict) -> Path:
    """`folder`'s config.json with the fields of `edit` set."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    return path
