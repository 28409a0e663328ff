"""The self-test: run a prepared GPU strategy once, collectively, on a small random input with
several tokens against the fp32 oracle, under a time limit. It catches what the static checks
don't know yet (e.g. FlashInfer writing all-zero FP4 on SM90) and admits a newer upstream kernel
that proves itself.

Disable with FUSION_BRIDGE_SELF_TEST=0 (or FusionBridge(..., self_test=False)).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from fusion_bridge.reasons import Reason
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy
from fusion_bridge.strategies.reference import ReferenceStrategy
from fusion_bridge.oracle.numerics import compare, failures
from fusion_bridge.oracle.synthetic import make_inputs

SELF_TEST_TOKENS = (
    7  # several tokens, odd: T=1 hides the H=2880 FlashInfer bug (docs/upstream.md section 1)
)
SELF_TEST_SEED = 20261130
SELF_TEST_TIME_LIMIT_S = 10.0


@dataclass(frozen=True)
class SelfTestResult:
    passed: bool
    worst_rel_err: Optional[float]
    reason: Optional[Reason]


def self_test(
    strategy: Strategy, spec: EpilogueSpec, rank: int, time_limit_s: float = SELF_TEST_TIME_LIMIT_S
) -> SelfTestResult:
    """Collective: every rank that prepared `strategy` calls this in the same order."""
    tokens = min(SELF_TEST_TOKENS, spec.max_tokens)
    limit = strategy.max_tokens_per_call(spec, strategy.env)
    if limit is not None:
        tokens = min(tokens, limit)
    inputs = make_inputs(spec, tokens, rank=rank, seed=SELF_TEST_SEED, device=strategy.device)
    oracle = ReferenceStrategy(spec, strategy.env, strategy.group, strategy.device)
    ref = oracle.run(inputs)
    start = time.monotonic()
    try:
        got = strategy.run(inputs)
        _wait(strategy.device, start, time_limit_s)
    except TimeoutError as exc:
        return SelfTestResult(
            False,
            None,
            Reason(
                "self_test_timeout",
                f"self-test: {exc}",
                "report this upstream; the strategy stays off",
            ),
        )
    except Exception as exc:  # a failing kernel rejects the strategy instead of the whole bridge
        return SelfTestResult(
            False,
            None,
            Reason(
                "self_test_error",
                f"self-test raised {type(exc).__name__}: {str(exc)[:300]}",
                "set FUSION_BRIDGE_SELF_TEST=0 only to debug; the strategy stays off",
            ),
        )
    errors = compare(spec, got, ref)
    bad = failures(spec, errors, ref, strategy.error_bound(spec, strategy.env))
    worst = max(e for e, _ in errors.values())
    if bad:
        return SelfTestResult(
            False,
            worst,
            Reason(
                "self_test_mismatch",
                f"self-test on T={tokens}, H={spec.hidden_size}, K={spec.top_k} against the fp32 "
                "oracle: " + "; ".join(bad),
                "the kernel computes another function here; the strategy stays off",
            ),
        )
    return SelfTestResult(True, worst, None)


def _wait(device: torch.device, start: float, time_limit_s: float) -> None:
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        if time.monotonic() - start > time_limit_s:
            raise TimeoutError(f"the kernel did not finish within {time_limit_s:.0f} s (hang?)")
        time.sleep(1e-4)
