"""The parameters a patched MoE layer reads, as they were when it was patched: a call checks them.

The patch's model check (hf_model_check) agrees on the model's parameters once, at patch time, and
the patched layer reads its block's, shared expert's and fused norm's parameters on every call
(the routed experts' local shards of an expert-parallel model, a plan-sharded shared expert's
local shards). A parameter replaced or re-sharded after patching, on some ranks or on all
(`load_state_dict(..., assign=True)`, `.to(dtype)` or `.to(device)`, transformers' plan applied
again, a parameter object swapped), would make the layer read weights the check never saw, or
shards laid out other than the split the patch computed. So each call first checks, for every
such parameter, that its module still holds the same object with the same local shape, dtype,
device and placements; otherwise it raises, naming the parameter and what changed, through the
layer's failure protocol (its peers' call completes with a NaN payload, no hang).

A value change in place (`load_state_dict` without assign, `param.copy_(...)`) keeps the object
and its layout and is not seen here: the ranks must then change it alike, as for any model.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fusion_bridge.integrations.weights_digest import is_dtensor, local


def _layout(p: torch.Tensor) -> tuple:
    """(local shape, dtype, device, placements) of a parameter (placements None: not a DTensor)."""
    placements = tuple(repr(x) for x in p.placements) if is_dtensor(p) else None
    return tuple(local(p).shape), p.dtype, p.device, placements


class _Entry(NamedTuple):
    """One watched parameter: where it is, and what a call compares (as it was when patched)."""

    full: str  # its path in the model
    owner: torch.nn.Module  # the module holding it
    name: str  # its name in owner._parameters
    param: torch.Tensor  # the object as patched
    dtype: torch.dtype
    shape: torch.Size  # its global shape (a DTensor's: the whole tensor's)
    device: torch.device
    placements: Optional[tuple]  # a DTensor's placements (None: a plain tensor)
    local_shape: torch.Size  # what this rank holds (a plain tensor: shape)


def _entry(full: str, owner: torch.nn.Module, name: str, p: torch.Tensor) -> _Entry:
    placements = tuple(p.placements) if is_dtensor(p) else None
    return _Entry(full, owner, name, p, p.dtype, p.shape, p.device, placements, local(p).shape)


def _layout_of(e: _Entry) -> tuple:
    """_layout of the parameter as it was when patched (from the entry's fields)."""
    placements = None if e.placements is None else tuple(repr(x) for x in e.placements)
    return tuple(e.local_shape), e.dtype, e.device, placements


class ParameterWatch:
    """The parameters of `modules` ({path: module}, submodules included, each parameter once) as
    they are now; `check()` raises RuntimeError naming the first one replaced or changed since."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.entries: list[_Entry] = []
        seen: set[int] = set()
        for path, module in modules.items():
            for sub, owner in module.named_modules(prefix=path):
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                for name, p in owner._parameters.items():
                    if p is not None:
                        self.entries.append(_entry(f"{sub}.{name}", owner, name, p))

    def changed(self) -> Optional[str]:
        """What changed about the first watched parameter that did (None: none did): each is
        compared field by field with what it was (the same object, dtype, global shape, device,
        and a DTensor's placements and local shape); _layout is built only for the message."""
        for e in self.entries:
            _, owner, name, param, dtype, shape, device, placements, local_shape = e
            now = owner._parameters.get(name)
            if (
                now is param
                and now.dtype is dtype
                and now.shape == shape
                and now.device == device
                and (
                    placements is None
                    or (now.placements == placements and now._local_tensor.shape == local_shape)
                )
            ):
                continue
            return self._what(e, now)
        return None

    @staticmethod
    def _what(e: _Entry, now: Optional[torch.Tensor]) -> str:
        """How `now`, the parameter at e's place, differs from e."""
        if now is not e.param:
            what = "removed" if now is None else "replaced by another parameter object"
            if now is not None and _layout(now) != _layout_of(e):
                what += f" (local shape, dtype, device, placements {_layout(now)})"
            return f"{e.full} was {what}"
        return (
            f"{e.full} changed its local shape, dtype, device or placements from "
            f"{_layout_of(e)} to {_layout(now)}"
        )

    def check(self) -> None:
        """Raise RuntimeError if a watched parameter was replaced or changed its layout."""
        what = self.changed()
        if what is not None:
            raise RuntimeError(
                f"patch_moe_epilogues: a parameter the patched layer reads changed after "
                f"patching: {what}. The patch computes its split from the parameters the "
                "ranks agreed on when patching (load_state_dict(assign=True), .to(), a plan "
                "applied again or a swapped parameter replace them). Call patch.unpatch() "
                "before changing the model's parameters, then patch_moe_epilogues(model) again"
            )
