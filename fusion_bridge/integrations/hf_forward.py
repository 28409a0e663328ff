"""The Hugging Face patch's own failure protocol: every forward makes every MoE layer's bridge call
on every rank, whatever fails on one rank.

Each MoE layer's bridge call is a collective. A rank whose forward fails before a layer's call (its
router, expert GEMMs or shared expert; the attention of that layer or of any layer before it; an
out-of-memory, a Ctrl-C) leaves its peers waiting in that call, and its next forward's calls would
pair with the peers' pending ones: plausible wrong logits on every rank from then on. So the patch
counts, per forward of the text model (`ForwardAccount`), which MoE layers made their call, and
when the forward fails on a rank, the rank takes part in each call it did not make, in layer order,
with `FusionBridge.fail_call` (a NaN payload of the forward's T), then re-raises. The peers' forward
returns NaN logits (loud); the next forward is correct on every rank. In debug mode the first such
call makes every rank raise the same GroupInputError (fail_call raises it, which ends the loop), and
a failed bridge call whose agreement every rank already saw (`group_saw_last_failure`) leaves
nothing to take part in.

A forward that returns with a layer's call missing or repeated (a hook that skipped the block, a
handoff never added to its residual) cannot be made up after the fact: the later calls have paired
with the peers' other calls. Then every bridge of the patch refuses every later call
(`mark_out_of_step`) and the forward raises, naming the layers; a new patch on that process group
raises too (`out_of_step_reason`), until it is created again.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

# process groups whose calls went out of step on this rank: (group, why); a new patch on one of
# them refuses (its model check would pair with a pending collective)
_OUT_OF_STEP: list[tuple[object, str]] = []


def out_of_step_reason(group) -> Optional[str]:
    """Why a patch on `group` went out of step on this rank, or None."""
    return next((why for g, why in _OUT_OF_STEP if g is group), None)


def record_out_of_step(group, why: str) -> None:
    if group is not None and out_of_step_reason(group) is None:
        _OUT_OF_STEP.append((group, why))


def tokens_of(args: tuple, kwargs: dict) -> Optional[int]:
    """T of a text model's forward (batch x sequence), read from input_ids or inputs_embeds; None
    when neither is a tensor."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 1 and embeds.shape[-1]:
        return embeds.numel() // embeds.shape[-1]
    return None


class ForwardAccount:
    """Which MoE layers made their bridge call in the forward under way on this rank.

    layers: {layer index: PatchedMoELayer}, filled as the patch builds them. Outside a forward of
    the text model (a block or decoder layer called directly) nothing is counted."""

    def __init__(self, group) -> None:
        self.group = group
        self.layers: dict = {}
        self.active = False
        self.tokens: Optional[int] = None
        self.called: list[int] = []
        self.settled = True  # the last bridge call (or fail_call) returned normally

    def calling(self, index: int, tokens: int) -> None:
        """Layer `index` is about to call its bridge with T tokens (the call counts from here: a
        bridge call that raises has taken part, or broken the group, itself)."""
        if self.active:
            self.called.append(index)
            self.tokens, self.settled = tokens, False

    def returned(self) -> None:
        self.settled = True

    def wrap(self, own_forward: Callable) -> Callable:
        """The text model's forward, counted (see the module docstring)."""

        @functools.wraps(own_forward)
        def forward(*args, **kwargs):
            if self.active or torch.compiler.is_compiling():
                return own_forward(*args, **kwargs)
            self.active, self.called, self.settled = True, [], True
            self.tokens = tokens_of(args, kwargs)
            try:
                try:
                    out = own_forward(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 - every failure keeps step
                    self._fail_rest(error)
                self._check_complete()
                return out
            finally:
                self.active = False

        return forward

    def _order(self) -> list[int]:
        return sorted(self.layers)

    def _fail_rest(self, error: BaseException):
        """This rank's forward failed: take part in each layer's call it did not make, then raise
        `error` (or, where this rank cannot take part, the bridge's refusal, from `error`)."""
        remaining = [i for i in self._order() if i not in self.called]
        if self.group is None:  # one process: no peer waits for a call
            raise error
        if not self.settled and self.layers[self.called[-1]].bridge.group_saw_last_failure:
            # debug mode's agreement made every rank raise in that call: no peer goes on
            remaining = []
        if remaining and self.tokens is None:
            self._out_of_step(
                f"the forward failed before MoE layer {remaining[0]}'s bridge call "
                f"({type(error).__name__}: {error}) and its token count could not be read from "
                "input_ids or inputs_embeds, so this rank could not take part in the calls its "
                f"peers make (layers {remaining})"
            )
            raise error
        try:
            for i in remaining:
                self.called.append(i)
                self.settled = False
                try:  # with the error, so that debug mode's agreement names it on every rank
                    self.layers[i].bridge.fail_call(self.tokens, error)
                except BaseException as raised:  # noqa: BLE001 - `error` itself: it took part
                    if raised is not error:
                        raise
                self.settled = True
        except BaseException as refusal:  # noqa: BLE001 - raised from the original failure
            if isinstance(refusal, Exception) and isinstance(error, Exception):
                raise refusal from error
            _note(error, f"fusion_bridge: then taking part failed: {refusal!r}")
            raise error from None
        if remaining:
            _note(
                error,
                f"fusion_bridge: this rank's forward failed before the bridge call of MoE "
                f"layer(s) {remaining}; it took part in each with a NaN payload of "
                f"T={self.tokens}, so its peers' forward gave NaN and the next forward is in step",
            )
        raise error

    def _check_complete(self) -> None:
        """A forward that returned made each layer's call exactly once, in layer order."""
        if self.called == self._order():
            return
        why = (
            f"a forward of the patched model returned having made the MoE layers' bridge calls "
            f"{self.called} where every forward makes {self._order()} in that order (a hook that "
            "skipped a block, a block output never added to its residual, or a layer run twice), "
            "so this rank's later calls pair with its peers' other calls"
        )
        self._out_of_step(why)
        raise RuntimeError(
            f"patch_moe_epilogues: {why}. Every bridge of the patch refuses every later call; on "
            "every rank: torch.distributed.destroy_process_group(), init_process_group() again, "
            "and patch the model again"
        )

    def _out_of_step(self, why: str) -> None:
        bridges = {id(p.bridge): p.bridge for p in self.layers.values()}
        for bridge in bridges.values():
            bridge.mark_out_of_step(why)
        record_out_of_step(self.group, why)


def _note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
