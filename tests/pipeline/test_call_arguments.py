"""A keyword argument a pipeline call does not take is one FluxError naming it and what to pass instead:
diffusers' spellings, another family's options, typos."""

from __future__ import annotations

import inspect

import pytest

from flux_runtime.pipeline import Pipeline, arguments
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.flux1 import Flux1Pipe
from flux_runtime.pipeline.flux2 import Flux2Pipe
from flux_runtime.pipeline.flux3 import Flux3Pipe

RECIPES = {"FLUX.1": Flux1Pipe, "FLUX.2": Flux2Pipe, "FLUX.3": Flux3Pipe}


@pytest.fixture(scope="module", params=["tiny", "tiny-flux2", "tiny-flux3-random"])
def pipe(request):
    return Pipeline.from_pretrained(request.param, device="cpu")


def _error(pipe, **kwargs) -> str:
    with pytest.raises(FluxError) as e:
        pipe("a red circle", height=64, width=64, num_steps=1, **kwargs)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{pipe.model_name} does not take ")
    return message


def test_diffusers_spellings_name_ours(pipe):
    message = _error(pipe, num_inference_steps=3, guidance_scale=2.0)
    assert "num_inference_steps is diffusers' argument; here pass num_steps=" in message
    assert "guidance_scale is diffusers' argument; here pass guidance=" in message
    assert "here pass seed= or generator=" in _error(pipe, latents=None)


def test_a_typo_gets_the_nearest_argument(pipe):
    assert "num_step is not an argument: did you mean num_steps?" in _error(pipe, num_step=3)
    assert _error(pipe, colour="red").endswith("colour is not an argument")


def test_another_familys_option_names_the_family_that_takes_it(pipe):
    family = next(f for f, cls in RECIPES.items() if isinstance(pipe, cls))
    for name, owner in arguments._FAMILY.items():
        if name in inspect.signature(type(pipe).__call__).parameters:
            continue
        message = _error(pipe, **{name: None})
        assert f"{name} is a {owner} argument and {pipe.model_name} is {family}" in message


def test_the_tables_name_what_the_recipes_really_take():
    """Each family option's hint names a family whose recipe takes it; no diffusers name is one of ours."""
    taken = {f: set(inspect.signature(cls.__call__).parameters) for f, cls in RECIPES.items()}
    for name, owner in arguments._FAMILY.items():
        assert name in taken[owner.split(" ")[0]], name
        assert any(name not in params for params in taken.values()), name  # some family refuses it
    for name in arguments._DIFFUSERS:
        assert all(name not in params for params in taken.values()), name


@pytest.mark.parametrize(
    ("side", "hint"),
    [(100, "e.g. 96 or 112"), (8, "e.g. 16"), (8184, "e.g. 8176 or 8192"), (1030, "e.g. 1024 or 1040")],
)
def test_a_size_off_the_grid_names_the_nearest_sizes(side, hint):
    from flux_runtime.pipeline.checks import check_size

    with pytest.raises(FluxError) as e:
        check_size(64, side, 16)
    assert str(e.value) == f"width {side} is not divisible by 16; give a multiple of 16, {hint}"


def test_an_ignored_argument_warns_at_the_callers_line(pipe):
    if not isinstance(pipe, Flux1Pipe):
        pytest.skip("true CFG is FLUX.1's")
    with pytest.warns(UserWarning, match="negative_prompt is used only with true_cfg_scale > 1") as said:
        pipe("a red circle", negative_prompt="blue", height=32, width=32, num_steps=1, output_type="latent")
    assert [w.filename for w in said] == [__file__]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(torch_dtype="bf16"),
            "Pipeline.from_pretrained does not take torch_dtype: torch_dtype is diffusers' argument; here pass dtype=",
        ),
        (dict(devise="cpu"), "devise is not an argument: did you mean device?"),
        (
            dict(local_files_only=True),
            "local_files_only is diffusers' argument; here pass download=False (or set HF_HUB_OFFLINE=1)",
        ),
        (dict(download="no"), "download must be True or False, got 'no'"),
        (
            dict(variant="fp16"),
            "unknown variant 'fp16': choose one of text2img, kontext, fill, control (diffusers'",
        ),
        (dict(fp8="yes"), "fp8 must be True or False, got 'yes'"),
        (dict(cuda_graphs=None), "cuda_graphs must be True or False, got None"),
    ],
)
def test_from_pretrained_names_what_it_does_not_take_before_loading(kwargs, message, monkeypatch):
    from flux_runtime.pipeline import entry

    def no_sources(*args, **kw):
        raise AssertionError("the checkpoint was opened")

    monkeypatch.setattr(entry, "find_sources", no_sources)
    monkeypatch.setattr(entry, "fetch_model", no_sources)
    with pytest.raises(FluxError) as e:
        Pipeline.from_pretrained("tiny", device="cpu", **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
