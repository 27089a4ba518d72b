"""Flow-matching sigma schedules: FLUX.1 dev/schnell and FLUX.2, bit-identical to diffusers.

diffusers builds the schedule in three places (`FluxPipeline.__call__`, `calculate_shift` and
`FlowMatchEulerDiscreteScheduler.set_timesteps`); this module is those steps in one function, with the
same numpy float32 arithmetic, so `get_schedule` returns the very tensors the scheduler would hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

MuRule = Literal["linear", "empirical"]


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How sigmas are shifted towards the noisy end, in `scheduler_config.json` vocabulary.

    `mu_rule=None` is a static shift `σ' = shift·σ / (1 + (shift − 1)·σ)` (schnell: shift 1, no change).
    Otherwise the exponential time shift `σ' = e^mu / (e^mu + (1/σ − 1))` runs with `mu` from the
    image token count (and, for FLUX.2, the step count); `shift` is then ignored, as in diffusers.

    - `"linear"` (FLUX.1-dev, diffusers `calculate_shift`): mu interpolates linearly from `base_shift` at
      `base_image_seq_len` tokens to `max_shift` at `max_image_seq_len` tokens (and extrapolates beyond).
    - `"empirical"` (FLUX.2, diffusers/BFL `compute_empirical_mu`): a fit in tokens and steps; the
      `base_*`/`max_*` fields are unused.
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    mu_rule: MuRule | None = None
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def __post_init__(self) -> None:
        if self.num_train_timesteps <= 0:
            raise ValueError(f"num_train_timesteps {self.num_train_timesteps} must be positive")
        if self.shift <= 0:
            raise ValueError(f"shift {self.shift} must be positive")
        if self.mu_rule not in (None, "linear", "empirical"):
            raise ValueError(f"mu_rule {self.mu_rule!r} is not one of None, 'linear', 'empirical'")
        if self.mu_rule == "linear" and self.max_image_seq_len == self.base_image_seq_len:
            raise ValueError(
                f"max_image_seq_len {self.max_image_seq_len} must differ from base_image_seq_len "
                f"{self.base_image_seq_len} for the linear mu rule"
            )

    def mu(self, image_seq_len: int, num_steps: int) -> float | None:
        """The exponential-shift parameter for `image_seq_len` image tokens and `num_steps` steps.

        None when the shift is static. Python float64 arithmetic in diffusers' order of operations.
        """
        if self.mu_rule is None:
            return None
        if self.mu_rule == "linear":
            # diffusers `calculate_shift`
            m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
            b = self.base_shift - m * self.base_image_seq_len
            return image_seq_len * m + b
        return _empirical_mu(image_seq_len, num_steps)


def _empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's mu: diffusers `compute_empirical_mu` (identical to BFL flux2 `sampling.py`).

    The constants are BFL's fit: lines in the token count for 10 and 200 steps, interpolated linearly in
    the step count; above 4300 tokens only the 200-step line is used.
    """
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


# FLUX.1-dev `scheduler/scheduler_config.json`: shift 3.0 with use_dynamic_shifting=true, so the 3.0 is
# unused and mu comes from the token count; base/max values are diffusers' defaults, which the config
# repeats (the gated JSON itself was not read, the values agree with BFL's `get_schedule`).
FLUX1_DEV_SCHEDULE = ScheduleConfig(shift=3.0, mu_rule="linear")
# FLUX.1-schnell: use_dynamic_shifting=false, shift=1.0, i.e. sigmas = linspace(1, 1/N, N) unchanged.
FLUX1_SCHNELL_SCHEDULE = ScheduleConfig(shift=1.0, mu_rule=None)
# FLUX.2 (dev and klein pipelines): the FLUX.1-dev scheduler config, but the pipeline passes the empirical mu
# (not verified for the klein repos' configs).
FLUX2_SCHEDULE = ScheduleConfig(shift=3.0, mu_rule="empirical")


class Schedule(NamedTuple):
    """`sigmas` fp32 `(N + 1,)` ending in 0.0; `timesteps` fp32 `(N,)` = `sigmas[:-1] * 1000`."""

    sigmas: Tensor
    timesteps: Tensor


def get_schedule(
    num_steps: int,
    image_seq_len: int,
    *,
    config: ScheduleConfig,
    device: torch.device | str | None = None,
) -> Schedule:
    """Sigmas and timesteps for `num_steps` Euler steps over `image_seq_len` packed image tokens.

    Reproduces `FluxPipeline` + `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...)` bit for
    bit: `linspace(1, 1/N, N)` in float64, cast to numpy float32, shifted in numpy float32, then
    `timesteps = sigmas * num_train_timesteps` in torch fp32 on `device` and a trailing 0 appended to sigmas.
    E.g. dev at 1024² (4096 tokens), 28 steps: timesteps 1000.0, 988.40863, ...; schnell, 4 steps:
    1000, 750, 500, 250.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps {num_steps!r} must be a positive integer")
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
        raise ValueError(f"image_seq_len {image_seq_len!r} must be a positive integer")

    # FluxPipeline: float64 linspace; set_timesteps: np.array(sigmas).astype(np.float32)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    mu = config.mu(image_seq_len, num_steps)
    if mu is None:
        # numpy float32 with Python-float scalars, as in set_timesteps' static branch
        sigmas = config.shift * sigmas / (1 + (config.shift - 1) * sigmas)
    else:
        # `_time_shift_exponential(mu, 1.0, sigmas)`: math.exp in float64, the rest numpy float32 (an overflow
        # is refused below, in one line, rather than warned about)
        with np.errstate(over="ignore", invalid="ignore"):
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)

    if not np.isfinite(sigmas).all():
        raise ValueError(
            f"the time-shifted schedule is not finite at {image_seq_len} image tokens (mu {mu}): the image is "
            "too large for the shift; give a smaller size"
        )
    sigmas_t = torch.from_numpy(sigmas).to(dtype=torch.float32, device=device)
    timesteps = sigmas_t * config.num_train_timesteps
    sigmas_t = torch.cat([sigmas_t, torch.zeros(1, device=sigmas_t.device)])
    return Schedule(sigmas=sigmas_t, timesteps=timesteps)
