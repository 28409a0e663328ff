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
