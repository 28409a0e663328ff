"""A DeepSeek-V3-style MoE block in plain torch, before and after moving its epilogue onto the
bridge.

    python -m migration.examples.deepseek_moe --world-size 2      # gloo on CPU, NCCL when 2 GPUs
    exist

The block: a sigmoid router with grouped top-k and routed scaling, routed experts whose output is
left
unfinalized in expert-sorted (permuted) order with an index map, a shared expert, tensor parallelism
(every expert's intermediate dimension is split over the ranks, so each rank holds a partial sum),
the
residual and the next layer's RMSNorm. `forward_before` ends the way model code does today, by hand;
`forward_after` hands the same tensors to FusionBridge. Small random weights; the shapes are the
point.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.oracle.numerics import rel_err


@dataclass(frozen=True)
class MoEConfig:
    hidden: int = 256
    experts: int = 16
    groups: int = 4  # n_group
    topk_groups: int = 2  # topk_group
    top_k: int = 4
    expert_inter: int = 64  # per expert, split over the TP ranks
    shared_inter: int = 128  # shared expert, split over the TP ranks
    routed_scaling: float = 2.5
    eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16


class DeepSeekMoEBlock(torch.nn.Module):
    def __init__(self, cfg: MoEConfig, rank: int, world: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(
            seed
        )  # same full weights on every rank; each keeps its shard

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(cfg.dtype)

        h, e, inter, shared = cfg.hidden, cfg.experts, cfg.expert_inter, cfg.shared_inter
        self.cfg, self.rank, self.world = cfg, rank, world
        self.gate = w(e, h, scale=h**-0.5).float()
        self.gate_bias = torch.randn(e, generator=g) * 0.01  # e_score_correction_bias
        shard = slice(rank * inter // world, (rank + 1) * inter // world)
        self.w1 = w(e, inter, h, scale=h**-0.5)[:, shard]  # gate proj, column-parallel
        self.w3 = w(e, inter, h, scale=h**-0.5)[:, shard]  # up proj, column-parallel
        self.w2 = w(e, h, inter, scale=inter**-0.5)[:, :, shard]  # down proj, row-parallel
        sshard = slice(rank * shared // world, (rank + 1) * shared // world)
        self.s1 = w(shared, h, scale=h**-0.5)[sshard]
        self.s3 = w(shared, h, scale=h**-0.5)[sshard]
        self.s2 = w(h, shared, scale=shared**-0.5)[:, sshard]
        self.norm_weight = (1 + 0.1 * torch.randn(h, generator=g)).to(
            cfg.dtype
        )  # the next layer's RMSNorm

    def to(self, device):  # plain tensors, not Parameters: move them by hand
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped top-k over sigmoid scores (DeepSeek-V3): -> expert ids [T, K], weights [T, K]
        fp32."""
        cfg = self.cfg
        scores = torch.sigmoid(x.float() @ self.gate.t())
        choice = scores + self.gate_bias
        grouped = choice.view(x.shape[0], cfg.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(
            1, group_scores.topk(cfg.topk_groups, dim=-1).indices, 1.0
        )
        masked = choice.masked_fill(
            ~keep.bool().repeat_interleave(cfg.experts // cfg.groups, 1), float("-inf")
        )
        ids = masked.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(
            -1, keepdim=True
        )  # routed_scaling is applied in the epilogue

    def experts(self, x: torch.Tensor):
        """Routed experts (unfinalized, expert-sorted rows + index map) and the shared expert, this
        rank's
        partial sums. Returns gemm2_out [P, H], expanded_idx_to_permuted_idx [T, K] int32, weights,
        shared."""
        cfg, tokens = self.cfg, x.shape[0]
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # permuted row p holds expanded slot order[p]
        perm = torch.empty_like(order)
        perm[order] = torch.arange(order.numel(), device=x.device)
        padding = 2  # grouped GEMMs pad; the rows are never read
        gemm2_out = torch.zeros(
            order.numel() + padding, cfg.hidden, dtype=cfg.dtype, device=x.device
        )
        token_of_row = order // cfg.top_k
        for e in range(cfg.experts):
            rows = (flat[order] == e).nonzero().squeeze(1)
            if rows.numel():
                xe = x[token_of_row[rows]]
                h = F.silu(xe @ self.w1[e].t()) * (xe @ self.w3[e].t())
                gemm2_out[rows] = h @ self.w2[e].t()
        shared = (F.silu(x @ self.s1.t()) * (x @ self.s3.t())) @ self.s2.t()
        return gemm2_out, perm.reshape(tokens, cfg.top_k).to(torch.int32), weights, shared

    def forward_before(self, x: torch.Tensor, residual: torch.Tensor, group=None):
        """Today's model code: the epilogue written out by hand."""
        gemm2_out, perm, weights, shared = self.experts(x)
        routed = (gemm2_out[perm.long()].float() * weights.unsqueeze(-1)).sum(
            1
        ) * self.cfg.routed_scaling
        hidden = routed.to(self.cfg.dtype) + shared
        if self.world > 1:
            dist.all_reduce(hidden, group=group)
        residual = residual + hidden
        var = residual.float().pow(2).mean(-1, keepdim=True)
        normed = (residual.float() * torch.rsqrt(var + self.cfg.eps) * self.norm_weight.float()).to(
            self.cfg.dtype
        )
        return normed, residual

    def make_bridge(self, group=None, **kwargs) -> FusionBridge:
        cfg = self.cfg
        spec = EpilogueSpec(
            hidden_size=cfg.hidden,
            top_k=cfg.top_k,
            dtype=cfg.dtype,
            eps=cfg.eps,
            routed_scaling_factor=cfg.routed_scaling,
            has_shared_output=True,
            max_tokens=1024,
        )
        return FusionBridge(spec, group, **kwargs)

    def forward_after(self, x: torch.Tensor, residual: torch.Tensor, bridge: FusionBridge):
        """The same block on the bridge: one call replaces the epilogue; the bridge picks the
        kernels."""
        gemm2_out, perm, weights, shared = self.experts(x)
        out = bridge.finalize_epilogue(gemm2_out, perm, weights, shared, residual, self.norm_weight)
        return out.norm_out, out.residual_out


def run_rank(rank: int, world: int, tokens: int, shadow: bool) -> dict:
    device = (
        torch.device("cuda", rank)
        if torch.cuda.is_available() and torch.cuda.device_count() >= world
        else torch.device("cpu")
    )
    group = dist.group.WORLD if world > 1 else None
    block = DeepSeekMoEBlock(MoEConfig(), rank, world).to(device)
    g = torch.Generator().manual_seed(1234)  # tokens are replicated across TP ranks
    x = torch.randn(tokens, block.cfg.hidden, generator=g).to(block.cfg.dtype).to(device)
    residual = torch.randn(tokens, block.cfg.hidden, generator=g).to(block.cfg.dtype).to(device)
    normed_before, residual_before = block.forward_before(x, residual, group)
    with block.make_bridge(group, shadow="reference:1" if shadow else None) as bridge:
        normed_after, residual_after = block.forward_after(x, residual, bridge)
        explained = bridge.explain(tokens)
        report = explained.to_dict()
        # the report's own text of the shadow statistics (what print(bridge.explain()) shows)
        shadow_text = str(explained).split("\nshadow ", 1)[1] if report["shadow"] else None
    return {
        "strategy": report["selected"],
        "device": device.type,
        "norm_rel_diff": rel_err(normed_after, normed_before),
        "residual_rel_diff": rel_err(residual_after, residual_before),
        "shadow": report["shadow"],
        "shadow_text": None if shadow_text is None else "shadow " + shadow_text.rstrip(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=13)
    ap.add_argument(
        "--shadow", action="store_true", help="also shadow the bridge with the fp32 reference"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.world_size == 1:
        results = [run_rank(0, 1, args.tokens, args.shadow)]
    else:
        from fusion_bridge.cli.launch import run_distributed

        results = run_distributed(
            run_rank, args.world_size, args.tokens, args.shadow, timeout_s=600
        )
    # before and after both round to bf16 a few times; 2^-6 is four bf16 roundings' worth of
    # difference
    agree = all(r["norm_rel_diff"] < 2**-6 and r["residual_rel_diff"] < 2**-6 for r in results)
    if args.json:
        print(json.dumps({"agree": agree, "ranks": results}, indent=2))
    else:
        for rank, r in enumerate(results):
            print(
                f"rank {rank} ({r['device']}): bridge picked {r['strategy']}; after vs before: "
                "norm_out "
                f"{r['norm_rel_diff']:.2e}, residual_out {r['residual_rel_diff']:.2e}"
            )
            if r["shadow_text"]:
                print("  " + r["shadow_text"].replace("\n", "\n  "))
        print("before and after agree" if agree else "before and after DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
