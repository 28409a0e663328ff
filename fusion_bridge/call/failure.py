"""What FusionBridge does when a call fails on one rank while its peers are in (or on their way to)
the call's collectives: take part with a NaN payload so the group stays in step, or, when that is
impossible, refuse every later call; and debug mode's per-call agreement, where every rank raises
the same error.

`CallFailures` is mixed into FusionBridge (bridge.py) and reads the state its build binds: spec,
env, group, device, calls, build_index, _instances, _shadow, _broken, _planned_route, _route, _run.
"""

from __future__ import annotations

from fusion_bridge.call import protocol as call_protocol
from fusion_bridge.ranks import agreement as rank_agreement
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.ranks.process_group import collective_device
from fusion_bridge.strategies.base import CallStage
from fusion_bridge.call.validation import (
    EpilogueInputError,
    validate_index_values,
    validate_inputs,
)


class CallFailures:
    """FusionBridge's failure path (see the module docstring)."""

    def _take_part_then_raise(self, inputs: EpilogueInputs, error: BaseException) -> None:
        """This rank's call failed before its collective, but its peers are already in (or on their
        way to) the call's collectives. Run the launches and collectives they run for the group's T,
        on a NaN payload, so the group stays in step and the peers get NaN outputs; then raise the
        original error. If T is unreadable or has no route, this rank cannot take part: the bridge
        refuses every later call (call_protocol.broken_message says what recovers)."""
        tokens = call_protocol.group_tokens(inputs)
        if self.env.world_size == 1 or tokens == 0:
            raise error
        route = self._planned_route(tokens) if tokens is not None else None
        if route is None:
            where = (
                "before its collective, and none of its [T, ...] inputs is a 2-D tensor, so it "
                "cannot tell the group's T"
                if tokens is None
                else f"before its collective, and T={tokens} has no route"
            )
            self._break(error, where)
            raise EpilogueInputError(self._broken) from error
        spec = self.spec
        try:
            poison = call_protocol.nan_payload(
                self.device,
                spec.dtype,
                spec.hidden_size,
                spec.top_k,
                tokens,
                spec.has_shared_output,
            )
            route[0].call_stage = CallStage.BEFORE_COLLECTIVE
            route[0].run(poison, route[1])
            if self._shadow is not None and self._shadow.due():  # the peers sample this call too
                self._instances[self._shadow.strategy].run(poison)
        except Exception as exc:  # noqa: BLE001 - reported with the original error
            self._break(
                error, f"before its collective; taking part with a NaN payload failed too ({exc!r})"
            )
            raise EpilogueInputError(self._broken) from error
        call_protocol.add_note(
            error,
            f"fusion_bridge: this rank took part in call {self.calls} with a NaN payload of "
            f"T={tokens}, so its peers got NaN outputs and the next call is in step",
        )
        raise error

    def _break(self, error: BaseException, where: str) -> None:
        self._broken = call_protocol.broken_message(self.calls, error, where)

    def _agreed_call(self, inputs: EpilogueInputs) -> EpilogueOutputs:
        """Debug mode over several ranks: local checks (index range included), then one small
        collective on (ok, T, call number) before the epilogue's collectives; if any rank failed,
        T differs or a rank is on another call, every rank raises the same error."""
        tokens = call_protocol.group_tokens(inputs)
        error, route = None, None
        try:
            validate_inputs(self.spec, inputs, self.device)
            validate_index_values(inputs)
            if tokens:
                route = self._route(inputs, tokens)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            error = exc
        rank_agreement.agree_call(
            error is None,
            -1 if tokens is None else tokens,
            None if error is None else f"{type(error).__name__}: {error}",
            self.group,
            collective_device(self.group, self.device),
            call=self.calls,
            bridge=self.build_index,
            fingerprint=call_protocol.replicated_fingerprint(inputs) if error is None else 0,
        )
        if not tokens:
            return allocate_outputs(self.spec, 0, self.device)
        return self._run(inputs, *route)
