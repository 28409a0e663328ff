"""The tensors that go into and come out of one epilogue call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


class EpilogueInputs(NamedTuple):
    """gemm2_out [P, H] act dtype: unfinalized routed-expert output, permuted rows (P may include padding).
    expanded_idx_to_permuted_idx [T, K] int32: row of gemm2_out for (token, k), -1 = skip.
    expert_weights [T, K] fp32/bf16/fp16. shared_output [T, H] act dtype or None.
    residual [T, H] act dtype. gamma [H] act dtype (RMSNorm weight)."""

    gemm2_out: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    expert_weights: torch.Tensor
    shared_output: Optional[torch.Tensor]
    residual: torch.Tensor
    gamma: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.expanded_idx_to_permuted_idx.shape[0]


@dataclass
class EpilogueOutputs:
    """residual_out, norm_out: [T, H] act dtype.
    quant: fp8 -> [T, H] float8_e4m3fn; nvfp4 -> [T, H/2] uint8 (2 e2m1 codes per byte, low nibble first).
    scale: nvfp4 only: uint8 e4m3 block scales, [round_up(T,128), round_up(H/16,4)] swizzled or [T, H/16]."""

    residual_out: torch.Tensor
    norm_out: torch.Tensor
    quant: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None

    def named(self) -> dict[str, torch.Tensor]:
        out = {"residual_out": self.residual_out, "norm_out": self.norm_out}
        if self.quant is not None:
            out["quant"] = self.quant
        if self.scale is not None:
            out["scale"] = self.scale
        return out
