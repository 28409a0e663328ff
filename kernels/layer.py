"""The record every launch of one layer passes, whatever the kernel family: the spec's scalars,
bound once when a strategy is prepared (no spec lookups on the call path). The symmetric-memory
kernels extend it with their workspace (kernels/symm/protocol.py, `SymmLayer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
