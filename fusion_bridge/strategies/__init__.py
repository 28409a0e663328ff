"""What a strategy author uses: subclass `Strategy` (one file per strategy), return `Reason`s from
its
capability checks over (`EpilogueSpec`, `Environment`), run on `EpilogueInputs`, and add one line
with
`register` (or to the built-in registry). See migration/README.md, "Adding a strategy"."""

from ..environment import Environment, Probe
from ..epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from ..reasons import Reason
from ..registry import REGISTRY, register, unregister
from ..spec import Stage
from .base import DEFAULT_VARIANT, Step, Strategy

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
]
