"""What the strategies whose call is one call of one of our kernel families' launchers share
(`fused_tp1`, `symm_fused_oneshot`, `symm_fused_twoshot`): the launcher bound once in prepare(),
and a call's outputs allocated and its records built, ready for the launcher."""

from __future__ import annotations

import torch

from typing import Optional

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, OutputAllocator
from fusion_bridge.kernels.records import RowOutputs, RowSource


class FamilyCall:
    """Mixin of a `Strategy`: `bind_launcher` in prepare(); in run(), `call_records` and one call
    of `self._launcher` with them (inside the collective mark for the multi-rank families: the
    allocation stays before it, where a failure still lets this rank take part)."""

    def bind_launcher(self, launcher) -> None:
        """Keep `launcher` (a `kernels.layer.FamilyLauncher` bound to this strategy's layer) and
        the empty uint8 tensor that stands for the codes and scales a quant mode does not have, and
        the allocator of a call's outputs on this strategy's device (`OutputAllocator`: made here,
        outside any CUDA-graph capture)."""
        self._launcher = launcher
        self._allocate = OutputAllocator(self.spec, self.device)
        self._unused = torch.empty(0, dtype=torch.uint8, device=self.device)

    def call_records(
        self, inputs: EpilogueInputs, out: Optional[EpilogueOutputs] = None
    ) -> tuple[EpilogueOutputs, RowSource, RowOutputs]:
        """A call's outputs (the caller's preallocated `out`, else allocated for T by
        `allocate_outputs` on this strategy's device, through `OutputAllocator`: what run()
        returns), and the launcher's records of it: `RowSource.of(inputs)` and the outputs'
        `RowOutputs` (the kernels write into them)."""
        if out is None:
            out = self._allocate(inputs.residual.shape[0])
        # RowSource.of(inputs), field for field: EpilogueInputs lists the same six tensors in the
        # same order (tests/kernels/test_tp1.py checks it)
        return out, _row_source(inputs), RowOutputs.of(out, self._unused)


_row_source = RowSource._make
