"""What the strategies whose call is one call of one of our kernel families' launchers share
(`fused_tp1`, `symm_fused_oneshot`, `symm_fused_twoshot`): the launcher bound once in prepare(),
and a call's outputs allocated and handed to it as records."""

from __future__ import annotations

from typing import Any, Optional

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.kernels.records import RowOutputs, RowSource


class FamilyCall:
    """Mixin of a `Strategy`: `bind_launcher` in prepare(), then `call_launcher` in run()."""

    def bind_launcher(self, launcher) -> None:
        """Keep `launcher` (a `kernels.layer.FamilyLauncher` bound to this strategy's layer) and
        the empty uint8 tensor that stands for the codes and scales a quant mode does not have."""
        self._launcher = launcher
        self._unused = torch.empty(0, dtype=torch.uint8, device=self.device)

    def call_launcher(
        self, inputs: EpilogueInputs, config: Optional[Any] = None
    ) -> EpilogueOutputs:
        """One call: the outputs allocated for T (`allocate_outputs`), the launcher called with
        `RowSource.of(inputs)` and their record; config None: the family's rule for T."""
        residual = inputs.residual
        out = allocate_outputs(self.spec, residual.shape[0], residual.device)
        self._launcher(RowSource.of(inputs), RowOutputs.of(out, self._unused), config)
        return out
