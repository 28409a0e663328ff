"""Debug mode over several ranks: one small collective per call, before the epilogue's own, on
which every rank agrees that every rank's call is good, has the same T and is the same step.

Each rank runs its checks (metadata, index range, the route for T, a fingerprint of its residual)
inside one try: whatever leaves them (any BaseException, a call on a closed bridge, an allocation
that fails while fingerprinting) becomes this rank's reason, and the rank still joins the agreement,
so the ranks stay on the same call. Then, if any rank failed, T differs or the ranks are not on the
same step, every rank raises the same GroupInputError (an exception that is not an Exception, such
as KeyboardInterrupt, is re-raised as itself on its rank, after the agreement).

The fingerprint is one checksum per input every rank of the group must hold identical at a step
(rank_agreement.REPLICATED: the residual, since residual_out = residual + the sum over ranks, and
the expert weights, the router's output), so the error says which of them differs. The index map is
left out: it is per rank in an expert-parallel layout (the Hugging Face patch's: -1 for the slots
another rank's experts hold). Each checksum is checksum.tensor_digest (BLAKE2b over the bytes, read
in bounded pieces: no two different inputs agree except by chance, and no copy the size of the
input). Each rank also sends the
fingerprint of its previous call of the bridge, so when ranks are a call apart the error names the
rank that is behind.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fusion_bridge.call.checksum import tensor_digest
from fusion_bridge.call.failure import BridgeClosedError, add_note
from fusion_bridge.call.payload import group_tokens
from fusion_bridge.call.validation import validate_index_values, validate_inputs
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.ranks import call_agreement as rank_agreement
from fusion_bridge.ranks.process_group import collective_device
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy

NO_FINGERPRINT = (0,) * len(rank_agreement.REPLICATED)  # none: the call failed its checks


class CallAgreement:
    """The per-call agreement of one bridge (its spec, device, process group and build index)."""

    def __init__(self, spec: EpilogueSpec, device: torch.device, group, bridge_index: int) -> None:
        self.spec, self.device, self.group, self.bridge_index = spec, device, group, bridge_index
        self.previous = NO_FINGERPRINT  # this rank's previous call's (none, or it failed)
        # how far this rank's agreement of call `progress_call` got (rank_agreement.agree_call)
        self.progress: list = [None]
        self.progress_call = 0
        self.reason: Optional[str] = None

    def agree(
        self,
        inputs: EpilogueInputs,
        call: int,
        route: Callable[[EpilogueInputs, int], tuple[Strategy, str]],
        closed: bool = False,
        failed: Optional[BaseException] = None,
    ) -> Optional[tuple[Strategy, str]]:
        """Local checks (index range included), the fingerprint and the route for T (`route(inputs,
        T)`, which may raise), then one small collective on (ok, T, call number `call`, this bridge,
        the fingerprint and the previous one). Returns the (strategy, variant) to run, or None when
        T == 0 (nothing to run, on every rank). Raises GroupInputError on every rank when any rank
        failed, T differs or the ranks are on different steps. `failed`: this rank's call already
        failed with it (the bridge's failure path joins the agreement with it, no checks)."""
        tokens = group_tokens(inputs, self.spec.has_shared_output)
        error: Optional[BaseException] = failed
        planned, fingerprint = None, NO_FINGERPRINT
        try:
            if failed is not None:
                raise failed
            if closed:
                raise BridgeClosedError("finalize_epilogue: this FusionBridge was closed")
            validate_inputs(self.spec, inputs, self.device)
            validate_index_values(inputs)
            fingerprint = replicated_fingerprint(inputs)
            if tokens:
                planned = route(inputs, tokens)
        except BaseException as exc:  # noqa: BLE001 - every rank learns it below
            error, fingerprint = exc, NO_FINGERPRINT
        previous, self.previous = self.previous, fingerprint
        self.reason = None if error is None else f"{type(error).__name__}: {error}"
        try:
            self.progress, self.progress_call = [None], call
            rank_agreement.agree_call(
                error is None,
                -1 if tokens is None else tokens,
                self.reason,
                self.group,
                collective_device(self.group, self.device),
                call=call,
                bridge=self.bridge_index,
                fingerprint=fingerprint,
                previous=previous,
                progress=self.progress,
            )
        except rank_agreement.GroupInputError as agreed:
            if error is not None and not isinstance(error, Exception):
                add_note(error, f"fusion_bridge: every rank of the group learnt it: {agreed}")
                raise error from None  # KeyboardInterrupt stays a KeyboardInterrupt
            raise
        return planned if tokens else None

    def my_reason(self) -> Optional[str]:
        """This rank's reason in its last agreement (None: its checks passed)."""
        return self.reason

    def where(self, call: int) -> Optional[str]:
        """How far call number `call`'s agreement got on this rank: None (its collective not
        begun: the peers wait in it), "in" (it began; whether it finished cannot be told), "runs"
        (every rank goes on to the epilogue's collectives) or "raises" (every rank raises)."""
        return rank_agreement.agreed_outcome(self.progress) if self.progress_call == call else None


def replicated_fingerprint(inputs: EpilogueInputs) -> tuple[int, ...]:
    """One checksum per input every rank of the TP group holds identical (the residual and the
    expert weights, in rank_agreement.REPLICATED's order): ranks whose fingerprints differ are not
    on the same step, and the message says which input differs. checksum.tensor_digest: any change
    of the bytes, a permutation included, changes it; its temporaries are bounded whatever T. Reads
    every byte (a sync and a pass over [T, H]): debug mode only."""
    return tuple(tensor_digest(t) for t in (inputs.residual, inputs.expert_weights))
