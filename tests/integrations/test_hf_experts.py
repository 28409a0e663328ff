"""The Hugging Face adapter's expert path (`hf_experts.routed_rows`) on real
transformers experts: its index chain gives, bit for bit, the rows and the map of the plain
chain (a held mask for every rank, the sort, the map as int64 cast to int32) on world size 1,
where it leaves the mask out, and on each rank of 2; and it reads nothing back to the host (no
op that syncs a CUDA device: a captured CUDA graph could not hold it)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from fusion_bridge.integrations import hf_experts as hx  # noqa: E402
from migration.examples.hf_moe_models import TINY, build_model  # noqa: E402

# ops that read a device tensor back to the host (or size their output by its values)
SYNCING = ("_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select", "item")


def plain_chain(x, ids, experts, local):
    """The chain with the held mask on every rank and the map cast from int64 (what routed_rows
    computed before it left the mask out at world size 1), the GEMMs as routed_rows does them."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    held = (flat >= local.start) & (flat < local.stop)
    key = torch.where(held, flat - local.start, len(local))
    sorted_key, order = torch.sort(key, stable=True)
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = torch.arange(order.numel())
    index_map = torch.where(held, row_of_slot, -1).view(tokens, top_k).to(torch.int32)
    ends = torch.searchsorted(sorted_key, torch.arange(1, len(local) + 1), out_int32=True)
    rows = x[order // top_k]
    transposed = bool(getattr(experts, "is_transposed", False))
    sl = slice(local.start, local.stop)
    gate_up = hx._in_out(experts.gate_up_proj[sl], transposed)
    down = hx._in_out(experts.down_proj[sl], transposed)
    projected = hx._grouped_linear(rows, gate_up, ends)
    if getattr(experts, "has_bias", False):
        projected.add_(experts.gate_up_proj_bias[sl][sorted_key.clamp(max=len(local) - 1)])
    out = hx._grouped_linear(experts._apply_gate(projected), down, ends)
    if getattr(experts, "has_bias", False):
        out.add_(experts.down_proj_bias[sl][sorted_key.clamp(max=len(local) - 1)])
    return out, index_map


@functools.lru_cache(maxsize=None)
def tiny(family: str) -> torch.nn.Module:
    return build_model(family, TINY)


def block_inputs(family: str, tokens: int):
    """(x [T, H] bf16, the block's router ids [T, K], its experts) of the first MoE layer."""
    model = tiny(family)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(tokens, TINY["hidden"], generator=torch.Generator().manual_seed(tokens))
    x = x.to(torch.bfloat16)
    router = block.gate if hasattr(block, "gate") else block.router
    with torch.no_grad():
        ids = router(x)[2]
    return x, ids, block.experts


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # plain; transposed with biases
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_the_index_chain_gives_the_plain_chains_rows_and_map_bit_for_bit(family, tokens):
    x, ids, experts = block_inputs(family, tokens)
    n = experts.gate_up_proj.shape[0]
    for local in (range(0, n), range(0, n // 2), range(n // 2, n)):
        with torch.no_grad():
            got_rows, got_map = hx.routed_rows(x, ids, experts, local)
            want_rows, want_map = plain_chain(x, ids, experts, local)
        assert got_map.dtype == torch.int32 and torch.equal(got_map, want_map), (local, got_map)
        read = want_map[want_map >= 0].long()  # rows no slot reads are left uninitialised
        assert torch.equal(got_rows[read], want_rows[read]), local
        assert (got_map >= 0).all() == (local == range(0, n))


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_expert_path_reads_nothing_back_to_the_host(family):
    x, ids, experts = block_inputs(family, 9)
    n = experts.gate_up_proj.shape[0]
    for local in (range(0, n), range(n // 2, n)):
        with torch.no_grad(), Recorder() as rec:
            hx.routed_rows(x, ids, experts, local)
        syncing = sorted({op for op in rec.ops if any(s in op for s in SYNCING)})
        assert not syncing, (local, syncing)
        assert "searchsorted" in rec.ops and "sort" in rec.ops  # the recorder saw the chain


def test_no_tokens_give_empty_rows_and_map():
    x, ids, experts = block_inputs("qwen3_moe", 3)
    with torch.no_grad():
        rows, index_map = hx.routed_rows(x[:0], ids[:0], experts, range(0, 8))
    assert rows.shape == (0, TINY["hidden"]) and index_map.shape == (0, TINY["top_k"])
