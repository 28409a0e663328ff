"""The record every launch of one layer passes, whatever the kernel family: the spec's scalars,
bound once when a strategy is prepared (no spec lookups on the call path). The symmetric-memory
kernels extend it with their workspace (kernels/symm/protocol.py, `SymmLayer`).

`FamilyLauncher`: the verbs of the launcher every kernel family has, bound to one layer
(`tp1.launcher.Tp1Launcher`, `symm.oneshot.OneshotLauncher`, `symm.twoshot.TwoshotLauncher`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from fusion_bridge.kernels.quant_codes import QuantArgs, quant_args
from fusion_bridge.kernels.records import LayerScalars


@dataclass(frozen=True)
class LayerRecord:
    """hidden: H; routed_scaling, eps, weight_bias: the spec's, as Python floats; quant: the
    output format's kernel code, layout and scale (`quant_codes.QuantArgs`). scalars: the same
    values as the kernels take them, one `records.LayerScalars` built with the record."""

    hidden: int
    routed_scaling: float
    eps: float
    weight_bias: float
    quant: QuantArgs
    scalars: LayerScalars = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        scalars = LayerScalars(self.routed_scaling, self.eps, self.weight_bias, self.quant.scale)
        object.__setattr__(self, "scalars", scalars)

    @classmethod
    def of(cls, spec) -> "LayerRecord":
        """From an EpilogueSpec."""
        return cls(**scalars_of(spec))


def scalars_of(spec) -> dict:
    """The record's fields from an EpilogueSpec (for records that extend LayerRecord)."""
    return dict(
        hidden=spec.hidden_size,
        routed_scaling=float(spec.routed_scaling_factor),
        eps=float(spec.eps),
        weight_bias=float(spec.weight_bias),
        quant=quant_args(spec),
    )


class FamilyLauncher(Protocol):
    """One kernel family's calls for one layer, each kernel launched through the launch cache
    (kernels/launch_cache.py). `src` / `out`: the call's `records.RowSource`
    (`RowSource.of(inputs)`) and `records.RowOutputs` (preallocated); `config`: the family's
    launch config (None: the family's rule for T, `config_for`)."""

    def __call__(self, src: Any, out: Any, config: Optional[Any] = None) -> None:
        """One call (T = src.perm.shape[0]; T == 0 launches nothing)."""

    def config_for(self, tokens: int) -> Any:
        """The config a call of T tokens launches with when it names none."""

    def bound(self, src: Any, out: Any, config: Optional[Any] = None) -> Callable[[], None]:
        """The call with everything decided beforehand: what an eager call is measured against
        (benchmarks). T > 0."""
