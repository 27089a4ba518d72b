"""`get_schedule` against diffusers' own FlowMatchEulerDiscreteScheduler, driven as FluxPipeline drives it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from flux_runtime.sampling import (
    FLUX1_DEV_SCHEDULE,
    FLUX1_SCHNELL_SCHEDULE,
    FLUX2_SCHEDULE,
    ScheduleConfig,
    get_schedule,
    num_image_tokens,
)
from tests.sampling.diffusers_refs import DEV_SCHEDULER_CONFIG, FLUX1_VARIANTS

STEPS = [1, 2, 4, 20, 28, 50]
# (height, width) in pixels: 256 to 2048 tokens-per-side regimes, non-square, beyond max_image_seq_len
SIZES = [(256, 256), (512, 512), (1024, 1024), (768, 1360), (1360, 768), (2048, 2048), (16, 16)]


def diffusers_flux1(config: dict, num_steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxPipeline.__call__ steps 5: sigmas, calculate_shift from the config, retrieve_timesteps."""
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(
        seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas, timesteps


def diffusers_flux2(num_steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux2Pipeline.__call__ step 6: the FLUX.1-dev scheduler config with the empirical mu."""
    scheduler = FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER_CONFIG)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = compute_empirical_mu(image_seq_len=seq_len, num_steps=num_steps)
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas, timesteps


def assert_same(ours, theirs) -> None:
    sigmas, timesteps = ours
    ref_sigmas, ref_timesteps = theirs
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert torch.equal(sigmas, ref_sigmas)
    assert torch.equal(timesteps, ref_timesteps)


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize(("height", "width"), SIZES)
@pytest.mark.parametrize("variant", list(FLUX1_VARIANTS))
def test_flux1_matches_diffusers(variant: str, num_steps: int, height: int, width: int) -> None:
    diffusers_config, config = FLUX1_VARIANTS[variant]
    seq_len = num_image_tokens(height, width)
    ours = get_schedule(num_steps, seq_len, config=config)
    assert_same(ours, diffusers_flux1(diffusers_config, num_steps, seq_len))


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("seq_len", [1, 256, 1024, 4096, 4300, 4301, 9000])
def test_flux2_matches_diffusers(num_steps: int, seq_len: int) -> None:
    assert FLUX2_SCHEDULE.mu(seq_len, num_steps) == compute_empirical_mu(seq_len, num_steps)
    ours = get_schedule(num_steps, seq_len, config=FLUX2_SCHEDULE)
    assert_same(ours, diffusers_flux2(num_steps, seq_len))


@pytest.mark.parametrize("seq_len", [1, 256, 1024, 4096, 8160])
def test_dev_mu_is_calculate_shift(seq_len: int) -> None:
    assert FLUX1_DEV_SCHEDULE.mu(seq_len, 28) == calculate_shift(seq_len)
    assert FLUX1_SCHNELL_SCHEDULE.mu(seq_len, 28) is None


def test_static_shift_other_than_one_matches_diffusers() -> None:
    # SD3-style static shift: exercises the static branch with arithmetic that actually changes sigmas
    config = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    ours = get_schedule(28, 4096, config=replace(FLUX1_SCHNELL_SCHEDULE, shift=3.0))
    assert_same(ours, diffusers_flux1(config, 28, 4096))
    assert not torch.equal(ours.sigmas, get_schedule(28, 4096, config=FLUX1_SCHNELL_SCHEDULE).sigmas)


def test_documented_examples() -> None:
    """Example schedule values (printed with 5 decimals there)."""
    dev = get_schedule(28, 4096, config=FLUX1_DEV_SCHEDULE)
    assert dev.timesteps.shape == (28,) and dev.sigmas.shape == (29,)
    expected = torch.tensor([1000.0, 988.40863, 976.22247, 963.39441])
    torch.testing.assert_close(dev.timesteps[:4], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(dev.timesteps[-1], torch.tensor(104.72090), rtol=0, atol=1e-5)
    assert dev.sigmas[-1].item() == 0.0

    schnell = get_schedule(4, 4096, config=FLUX1_SCHNELL_SCHEDULE)
    assert schnell.timesteps.tolist() == [1000.0, 750.0, 500.0, 250.0]
    assert schnell.sigmas.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]

    assert FLUX1_DEV_SCHEDULE.mu(4096, 28) == pytest.approx(1.15)
    assert FLUX1_DEV_SCHEDULE.mu(1024, 28) == pytest.approx(0.63)
    for steps, mu in [(50, 2.023351157), (28, 2.151443162), (4, 2.291179894)]:
        assert FLUX2_SCHEDULE.mu(4096, steps) == pytest.approx(mu, abs=1e-9)
    klein = get_schedule(4, 4096, config=FLUX2_SCHEDULE)
    torch.testing.assert_close(
        klein.timesteps, torch.tensor([1000.0, 967.38403, 908.14392, 767.19995]), rtol=0, atol=1e-4
    )


def test_timesteps_are_sigmas_times_1000() -> None:
    s = get_schedule(28, 3000, config=FLUX1_DEV_SCHEDULE)
    assert torch.equal(s.timesteps, s.sigmas[:-1] * 1000)
    assert bool((s.sigmas[1:] < s.sigmas[:-1]).all())


def test_device_argument() -> None:
    s = get_schedule(4, 4096, config=FLUX1_DEV_SCHEDULE, device="meta")
    assert s.sigmas.device.type == s.timesteps.device.type == "meta"


@pytest.mark.parametrize(
    ("num_steps", "seq_len", "message"),
    [
        (0, 4096, "num_steps 0 must be a positive integer"),
        (2.5, 4096, "num_steps 2.5 must be a positive integer"),
        (True, 4096, "num_steps True must be a positive integer"),
        (4, 0, "image_seq_len 0 must be a positive integer"),
    ],
)
def test_bad_arguments(num_steps, seq_len, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_schedule(num_steps, seq_len, config=FLUX1_DEV_SCHEDULE)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_train_timesteps=0), "num_train_timesteps 0 must be positive"),
        (dict(shift=-1.0), "shift -1.0 must be positive"),
        (dict(mu_rule="quadratic"), "mu_rule 'quadratic' is not one of"),
        (dict(mu_rule="linear", base_image_seq_len=4096), "max_image_seq_len 4096 must differ"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**kwargs)


def test_presets_are_frozen() -> None:
    with pytest.raises(AttributeError):
        FLUX1_DEV_SCHEDULE.shift = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(("expected", "cfg"), list(FLUX1_VARIANTS.values()))
def test_presets_are_the_scheduler_configs(cfg: ScheduleConfig, expected: dict) -> None:
    """Our presets, written back as FlowMatchEulerDiscreteScheduler arguments, are the repos' scheduler configs."""
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        shift=cfg.shift,
        use_dynamic_shifting=cfg.mu_rule is not None,
        base_image_seq_len=cfg.base_image_seq_len,
        max_image_seq_len=cfg.max_image_seq_len,
        base_shift=cfg.base_shift,
        max_shift=cfg.max_shift,
    )
    assert {k: scheduler.config[k] for k in expected} == expected


def test_a_shift_that_overflows_is_refused_not_nan() -> None:
    # 16000² px is a million tokens: exp(mu) overflows float32 and every sigma would be NaN
    with pytest.raises(ValueError, match="schedule is not finite at 1000000 image tokens"):
        get_schedule(28, 1_000_000, config=FLUX1_DEV_SCHEDULE)
    assert torch.isfinite(get_schedule(28, (8192 // 16) ** 2, config=FLUX1_DEV_SCHEDULE).sigmas).all()
    assert torch.isfinite(get_schedule(28, (8192 // 16) ** 2, config=FLUX2_SCHEDULE).sigmas).all()
