"""`size_multiple`: the side multiple flux-gen checks before it reads any weights, per registry name."""

from __future__ import annotations

import pytest

from flux_runtime.registry import MODELS
from flux_runtime.weights.builtin import PUBLISHED_SIZE_MULTIPLE, builtin, size_multiple


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if s.builtin])
def test_a_builtin_models_multiple_is_its_autoencoders(name):
    model = builtin(name)
    assert model is not None
    assert size_multiple(name) == 2 * model.vae.spatial_factor


def test_published_checkpoints_take_sixteen_except_kontext():
    for name, spec in MODELS.items():
        if spec.builtin:
            continue
        want = None if spec.variant == "kontext" else PUBLISHED_SIZE_MULTIPLE
        assert size_multiple(name) == want, name
        assert size_multiple(spec.hub_id) == want, spec.hub_id  # the hub id says the same as the name


def test_paths_and_unknown_ids_are_left_to_the_pipeline(tmp_path, monkeypatch):
    assert size_multiple(tmp_path) is None
    assert size_multiple("someone/some-flux-finetune") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flux1-dev").mkdir()  # a folder named like a registry name: left to the pipeline too
    assert size_multiple("flux1-dev") is None
