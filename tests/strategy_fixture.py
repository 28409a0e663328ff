"""A strategy defined outside the package, to show registration is one line."""

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
