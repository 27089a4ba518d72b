"""Step-cache policies on their own: spec strings, the decisions, what a reused step hands the final layer."""

from __future__ import annotations

import math

import pytest
import torch

from flux_runtime.sampling.step_cache import (
    CacheSpecError,
    FirstBlockCache,
    TaylorCache,
    cache_record,
    parse_cache,
)


def test_specs_parse_and_print_back_in_full() -> None:
    policy = parse_cache("first-block:threshold=0.08")
    assert policy == FirstBlockCache(threshold=0.08)
    assert policy.spec == "first-block:warmup=1,last=1,probe=1,threshold=0.08"
    assert parse_cache(policy.spec) == policy
    taylor = parse_cache(" taylor:order=1, refresh=3,warmup=2 ")
    assert taylor == TaylorCache(order=1, refresh=3, warmup=2)
    assert parse_cache(taylor.spec) == taylor
    assert parse_cache("taylor") == TaylorCache()
    for off in (None, "", "off", "none"):
        assert parse_cache(off) is None
    assert parse_cache(taylor) is taylor


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fbcache", "unknown cache policy 'fbcache': give one of first-block, taylor"),
        ("first-block:threshold=1.5", "threshold 1.5 is out of range: give 0 to 1"),
        ("first-block:threshold=-0.1", "threshold -0.1 is out of range"),
        ("first-block:threshold=nan", "threshold nan is out of range"),
        ("first-block:threshold=high", "threshold='high' is not a number"),
        ("taylor:refresh=0", "refresh=0 is out of range: give a whole number >= 1"),
        ("taylor:order=3", "taylor order 3 is not supported: give 1 or 2"),
        ("taylor:order=1.5", "order='1.5' is not a whole number"),
        ("first-block:probe=0", "probe=0 is out of range"),
        ("taylor:warmup=-1", "warmup=-1 is out of range"),
        ("taylor:threshold=0.1", "'threshold=0.1' is not key=value with a key of taylor"),
        ("first-block:0.1", "'0.1' is not key=value"),
    ],
)
def test_bad_specs_say_what_and_the_fix(spec: str, message: str) -> None:
    with pytest.raises(CacheSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cache(spec)


def test_a_spec_must_be_a_string() -> None:
    with pytest.raises(CacheSpecError, match="spec string"):
        parse_cache(0.12)  # type: ignore[arg-type]


def _full_step(cache, probe_in, probe_out, out):
    assert cache.before_rest(probe_in, probe_out) is None
    cache.after_rest(out)


def test_first_block_reuses_while_the_probe_residual_stays_close() -> None:
    cache = FirstBlockCache(threshold=0.1, warmup=1, last=1).start(steps=5)
    x = torch.randn(1, 6, 4)
    probe = x + 1.0  # the probe's residual: 1 everywhere
    out = probe + 3.0  # the rest's residual: 3
    _full_step(cache, x, probe, out)  # step 0: warm-up
    # step 1: the probe's residual changed by 5 % -> reuse: the probe's output plus the cached remainder
    probe1 = x + 1.05
    reused = cache.before_rest(x, probe1)
    assert reused is not None and torch.allclose(reused, probe1 + 3.0)
    assert math.isclose(cache.last_change, 0.05, rel_tol=1e-4)
    # step 2: changed by 50 % against the last full step's (step 0's) -> the rest runs
    assert cache.before_rest(x, x + 1.5) is None
    cache.after_rest(x + 1.5 + 2.0)
    # step 3 compares with step 2's residual now, and reuses its remainder (2)
    reused = cache.before_rest(x, x + 1.52)
    assert reused is not None and torch.allclose(reused, x + 1.52 + 2.0)
    # step 4: the last step always runs, however close
    assert cache.before_rest(x, x + 1.5) is None
    cache.after_rest(x)
    assert cache.computed == [0, 2, 4] and cache.step == 5


def test_threshold_zero_and_refresh_one_never_reuse() -> None:
    for policy in (FirstBlockCache(threshold=0.0), TaylorCache(refresh=1)):
        cache = policy.start(steps=6)
        x = torch.zeros(1, 2, 2)
        for _ in range(6):
            _full_step(cache, x, x + 1, x + 2)
        assert cache.computed == list(range(6))


@pytest.mark.parametrize("order", [1, 2])
def test_taylor_forecasts_a_polynomial_remainder_exactly(order: int) -> None:
    """A remainder of degree `order` in the step is forecast exactly from full steps at any spacing."""
    a, b, c = (torch.randn(1, 8, 3, dtype=torch.float64) for _ in range(3))

    def remainder(i: int) -> torch.Tensor:
        return a + b * i + (c * i * i if order == 2 else 0)

    policy = TaylorCache(order=order, refresh=3, warmup=0, last=1)
    cache = policy.start(steps=12)
    x = torch.zeros(1, 8, 3, dtype=torch.float64)
    computed = []
    for i in range(12):
        got = cache.before_rest(x, x)
        if got is None:
            cache.after_rest(remainder(i))
            computed.append(i)
        else:
            torch.testing.assert_close(got, remainder(i), rtol=1e-5, atol=1e-5)  # kept in float32
    # full steps until order + 1 are known, then one in `refresh`, and the last
    assert computed == list(range(order + 1)) + list(range(order + 3, 11, 3)) + [11]
    assert cache.computed == computed


def test_records_name_the_policy_and_each_branch() -> None:
    policy = FirstBlockCache(threshold=0.0)
    cond, uncond = policy.start(3), policy.start(3)
    x = torch.zeros(1, 1, 1)
    for cache in (cond, uncond):
        for _ in range(3):
            _full_step(cache, x, x, x)
    one = cache_record(policy, {"cond": cond})
    assert one == {
        "spec": policy.spec,
        "policy": "first-block",
        "params": {"warmup": 1, "last": 1, "probe": 1, "threshold": 0.0},
        "computed_steps": [0, 1, 2],
        "calls": 3,
    }
    both = cache_record(policy, {"cond": cond, "uncond": uncond})
    assert both["branches"]["uncond"] == {"computed_steps": [0, 1, 2], "calls": 3}
