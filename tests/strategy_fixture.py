"""A strategy defined outside the package, to show registration is one line."""

from fusion_bridge.strategies.separate import SeparateStrategy


class SeparateAgain(SeparateStrategy):
    name = "separate_again"
    summary = "the separate path under another name"
