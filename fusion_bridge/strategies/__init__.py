"""What a strategy author uses: subclass `Strategy` (one file per strategy), declare its launch
`Step`s (covering `required_stages`), return `Reason`s from its capability checks over
(`EpilogueSpec`, `Environment`; a fact only it needs is its own `Probe`), run on `EpilogueInputs`,
and add one line with `register` (or to the built-in registry). `strategy_class(es)` give the
registered classes. See migration/README.md, "Adopt a new upstream fusion as a strategy"."""

from fusion_bridge.environment import Environment, Probe
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.reasons import Reason
from fusion_bridge.registry import (
    REGISTRY,
    register,
    strategy_class,
    strategy_classes,
    unregister,
)
from fusion_bridge.spec import Stage
from fusion_bridge.strategies.base import (
    DEFAULT_VARIANT,
    Step,
    Strategy,
    TokenRange,
    required_stages,
)

__all__ = [
    "Strategy",
    "Step",
    "Stage",
    "Reason",
    "Environment",
    "Probe",
    "EpilogueInputs",
    "EpilogueOutputs",
    "allocate_outputs",
    "register",
    "unregister",
    "REGISTRY",
    "DEFAULT_VARIANT",
    "TokenRange",
    "required_stages",
    "strategy_class",
    "strategy_classes",
]
