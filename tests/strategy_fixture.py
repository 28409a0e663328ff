"""A strategy defined outside the package, to show registration is one line."""

import threading

from fusion_bridge.strategies import Probe, Reason
from fusion_bridge.strategies.separate import SeparateStrategy


class SeparateAgain(SeparateStrategy):
    name = "separate_again"
    summary = "the separate path under another name"


class TwoVariants(SeparateStrategy):
    """The separate path with two launch variants that record which one ran."""

    name = "two_variants"
    summary = "the separate path, launched as variant 'a' or 'b'"
    ran: list = []

    @classmethod
    def variants(cls, spec, env):
        return ("a", "b")

    def run(self, inputs, variant="a"):
        TwoVariants.ran.append(variant)
        return super().run(inputs, variant)


class OptInSeparate(SeparateStrategy):
    """The separate path as an opt-in strategy that counts its prepares."""

    name = "opt_in_separate"
    summary = "the separate path, opt-in"
    opt_in = True
    prepared = 0

    def prepare(self) -> None:
        OptInSeparate.prepared += 1
        super().prepare()


class RangedVariants(SeparateStrategy):
    """The separate path with variant 'a' for any T and 'b' only for T >= 3 (a declared range, like
    FlashInfer's two-shot), recording which one ran. Its default prefers 'b' everywhere."""

    name = "ranged_variants"
    summary = "the separate path, launched as variant 'a' (any T) or 'b' (T >= 3)"
    ran: list = []

    @classmethod
    def variants(cls, spec, env):
        return ("a", "b")

    @classmethod
    def variant_tokens(cls, spec, env):
        return {"b": (3, None)}

    @classmethod
    def default_variant(cls, spec, env, tokens):
        return "b"

    def run(self, inputs, variant="a"):
        RangedVariants.ran.append(variant)
        return super().run(inputs, variant)


def _read_fixture_flag() -> str:
    return "read from this process"


class ProbedSeparate(SeparateStrategy):
    """The separate path, runnable only where its own probe reads "ok": a strategy that brings a
    fact about the process that no other strategy needs."""

    name = "probed_separate"
    summary = "the separate path, gated by its own environment probe"
    FLAG = Probe("fixture_flag", _read_fixture_flag, documented="ok")
    probes = (FLAG,)

    @classmethod
    def not_supported_reasons(cls, spec, env):
        flag = cls.FLAG.value_in(env)
        if flag == "ok":
            return super().not_supported_reasons(spec, env)
        return [Reason("fixture_flag_not_ok", f"{cls.name}: fixture_flag is {flag!r}", "")]


class PrepareFailsOnRankOne(SeparateStrategy):
    """The separate path whose prepare() raises on rank 1 of the default group only (a collective
    setup that fails on one rank); counts the closes of its instances in this process."""

    name = "prepare_fails_on_rank_one"
    summary = "the separate path, whose prepare fails on rank 1"
    closed = 0

    def prepare(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("prepare failed on rank 1 (test fixture)")
        super().prepare()

    def close(self) -> None:
        PrepareFailsOnRankOne.closed += 1
        super().close()


class PausingSeparate(SeparateStrategy):
    """The separate path whose run, while `hold` is set, signals `entered` and waits for `release`
    before computing (so before its collective): a call that stays in flight, in this process,
    while another thread calls the same bridge. `reset()` before each use."""

    name = "pausing_separate"
    summary = "the separate path, pausing inside its run on request"
    hold = False
    entered = threading.Event()
    release = threading.Event()

    @classmethod
    def reset(cls, hold: bool) -> None:
        cls.hold = hold
        cls.entered, cls.release = threading.Event(), threading.Event()

    def run(self, inputs, variant="default"):
        if PausingSeparate.hold:
            if PausingSeparate.entered.is_set():  # a second call got in while one is held
                raise AssertionError("two calls inside pausing_separate's run at once")
            PausingSeparate.entered.set()
            assert PausingSeparate.release.wait(60), "never released"
        return super().run(inputs, variant)
