"""The strategy registry: name -> "module:Class", imported lazily.

Adding a strategy is one file under strategies/ plus one line here. The public view is read-only and
registration refuses to overwrite a name silently.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any, Mapping

# fused_tp1 runs at world size 1 only (one launch; measured faster than local_fused_nccl from T=16
# on, slower at T=1), so it comes first. Order is the static preference when nothing was measured:
# fastest first, as measured on 2x H200: our finalize + FlashInfer AR+norm, our finalize + NCCL +
# our norm, FlashInfer's fused MoE-finalize (the times and the world-size-1 comparison:
# docs/performance.md#figures-behind-the-codes-choices). symm_fused_oneshot (ours, one launch,
# small T) is measured only at TP2, where the shipped H200 table selects it by speed; without a
# table it comes after the NCCL path, which is validated at every world size. symm_fused_twoshot
# (ours, one launch, large T) is opt-in: auto neither prepares nor picks it, with a table or
# without; a request by name runs it.
_REGISTRY: dict[str, str] = {
    "fused_tp1": "fusion_bridge.strategies.fused_tp1:FusedTp1Strategy",  # world size 1 only
    "local_fused_flashinfer": "fusion_bridge.strategies.local_fused_flashinfer:LocalFusedFlashInferStrategy",  # noqa: E501
    "local_fused_nccl": "fusion_bridge.strategies.local_fused_nccl:LocalFusedNcclStrategy",
    "symm_fused_oneshot": "fusion_bridge.strategies.symm_fused_oneshot:SymmFusedOneshotStrategy",
    "symm_fused_twoshot": "fusion_bridge.strategies.symm_fused_twoshot:SymmFusedTwoshotStrategy",
    "flashinfer_fused": "fusion_bridge.strategies.flashinfer_fused:FlashInferFusedStrategy",
    "flashinfer_fused_fp4": "fusion_bridge.strategies.flashinfer_fused_fp4:FlashInferFusedFp4Strategy",  # noqa: E501
    "separate": "fusion_bridge.strategies.separate:SeparateStrategy",
    "reference": "fusion_bridge.strategies.reference:ReferenceStrategy",
}

REGISTRY: Mapping[str, str] = MappingProxyType(_REGISTRY)


def register(name: str, target: str, *, replace: bool = False) -> None:
    """Add a strategy ("package.module:Class"). Refuses to overwrite unless replace=True."""
    if ":" not in target:
        raise ValueError(f"register: target must be 'module:Class', got {target!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"register: strategy {name!r} is already registered as {_REGISTRY[name]!r}; "
            "pass replace=True to override it"
        )
    _REGISTRY[name] = target


def unregister(name: str) -> None:
    if name not in _REGISTRY:
        raise KeyError(f"unregister: no strategy named {name!r}; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


def strategy_class(name: str) -> type:
    """The registered Strategy subclass called `name` (its module imported on first use)."""
    if name not in _REGISTRY:
        raise ValueError(f"strategy must be 'auto' or one of {list(_REGISTRY)}, got {name!r}")
    module_name, _, class_name = _REGISTRY[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if cls.name != name:
        raise RuntimeError(f"registry entry {name!r} points at a class named {cls.name!r}")
    return cls


def strategy_classes() -> list[type]:
    """Every registered Strategy subclass, in registry order (the static preference)."""
    return [strategy_class(n) for n in _REGISTRY]


def environment_probes() -> dict[str, Any]:
    """name -> environment.Probe: what detect() runs, collected from every registered strategy's
    `probes` (environment imports this module, so no import back). Two strategies may share a
    probe (the same Probe object); two different probes of one name are an error naming
    both strategies."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for cls in strategy_classes():
        for probe in cls.probes:
            if probe.name in out and out[probe.name] is not probe:
                raise ValueError(
                    f"strategies {owner[probe.name]!r} and {cls.name!r} declare different "
                    f"environment probes named {probe.name!r}; rename one"
                )
            out.setdefault(probe.name, probe)
            owner.setdefault(probe.name, cls.name)
    return out
