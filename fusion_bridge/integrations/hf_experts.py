"""One rank's share of a transformers MoE block, in the form an engine hands to the fused epilogue.

Split over a group of W ranks (every rank holds the whole model; only the work is divided):
  - routed experts: rank r computes experts [r*E//W, (r+1)*E//W) (contiguous blocks, the usual
    expert-parallel placement); slots routed to other ranks' experts are -1 in its index map;
  - shared expert: rank r computes intermediate columns [r*I//W, (r+1)*I//W) of gate/up and the
    matching columns of down_proj (tensor-parallel), a partial sum of the shared output.
The bridge's all-reduce adds the W partials.

The expert path reads the layout flags transformers' `use_experts_implementation` sets on the
experts (is_transposed, has_bias) and calls their `_apply_gate`, so one path serves every family.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fusion_bridge.integrations.weights_digest import local

_local = local  # under the name routed_rows' `local` (its held range) does not shadow

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def block_of(rank: int, world: int, count: int) -> range:
    """The contiguous block [rank*count//world, (rank+1)*count//world) that rank owns."""
    return range(rank * count // world, (rank + 1) * count // world)


def _grouped_linear(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [S, in] (sorted by group), weights [G, in, out] (any strides), ends [G] int32 cumulative
    row counts -> [S, out]; rows past ends[-1] are left uninitialised (nobody reads them). One
    grouped GEMM on CUDA SM80+ with 16-byte aligned shapes (no host sync: CUDA-graph safe); no
    rows: nothing read; else one GEMM per group, whose bounds are read on the host (`tolist`: on
    CPU a read of host memory, on a CUDA device without the grouped GEMM a sync that a CUDA graph
    cannot capture)."""
    if rows.shape[0] == 0:  # T == 0: nothing to multiply, and ends is not read
        return rows.new_empty(0, weights.shape[2])
    if _GROUPED_MM is not None and _grouped_mm_ok(rows, weights):
        return _GROUPED_MM(rows, weights, offs=ends)
    out = rows.new_empty(rows.shape[0], weights.shape[2])
    # on CPU in fp32: bf16 GEMMs there are several times slower, and a bf16 GEMM accumulates in
    # fp32 and rounds its output once, which is what the cast back does
    compute = torch.float32 if rows.device.type == "cpu" else rows.dtype
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            rows_g = rows[start:end].to(compute)
            out[start:end] = (rows_g @ weights[g].to(compute)).to(rows.dtype)
        start = end
    return out


def _grouped_mm_ok(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    # CUDA SM80+ only: torch's CPU grouped_mm is far slower than one GEMM per group (and on CPU
    # nothing is captured, so the host sync of the loop costs nothing). The kernel wants 16-byte
    # aligned rows and strides (bf16/fp16: inner dims multiples of 8).
    aligned = all(d % 8 == 0 for d in weights.shape[1:])
    return rows.device.type == "cuda" and aligned and _sm80_or_newer(rows.device)


@functools.lru_cache(maxsize=None)
def _sm80_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _group_bounds(groups: int, device: torch.device) -> torch.Tensor:
    """[1, 2, ..., groups] int64: searchsorted against it gives each group's cumulative end. Made
    once per (groups, device), so a call (or a captured CUDA graph) reuses it."""
    return torch.arange(1, groups + 1, device=device)


_POSITIONS: dict = {}  # device -> every arange made for it, the largest last (none is freed)


def _positions(count: int, device: torch.device) -> torch.Tensor:
    """[0, 1, ..., count-1] int32 (the index map's dtype) on device: a view of a cached arange,
    grown (doubled) when a call needs more, so a call makes no arange of its own. A grown arange
    never frees the smaller ones: a CUDA graph captured earlier keeps reading the storage it
    captured."""
    made = _POSITIONS.setdefault(device, [])
    if not made or made[-1].numel() < count:
        size = max(count, 2 * (made[-1].numel() if made else 64))
        made.append(torch.arange(size, dtype=torch.int32, device=device))
    return made[-1][:count]


def _in_out(weights: torch.Tensor, transposed: bool) -> torch.Tensor:
    """transformers' [G, out, in] expert weights (or [G, in, out] when the experts say
    is_transposed) as the [G, in, out] view a grouped GEMM multiplies rows by."""
    return weights if transposed else weights.transpose(-2, -1)


def routed_rows(
    x: torch.Tensor, ids: torch.Tensor, experts: torch.nn.Module, local: range, held_from: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's routed experts on x [T, H] with top-k ids [T, K], computed as transformers'
    grouped_mm / batched_mm experts compute one row: gate_up GEMM (+ its bias, added in the
    activation dtype), the experts' own `_apply_gate` (concatenated or interleaved gate/up, the
    family's activation and clamps), down GEMM (+ its bias).

    Returns gemm2_out [T*K, H] x.dtype (the down projection's output, unweighted, rows sorted by
    expert: the permuted layout a grouped GEMM produces; rows of slots this rank does not hold are
    left uninitialised) and expanded_idx_to_permuted_idx [T, K] int32 (the row of each (token, k)
    slot, -1 where another rank holds the expert).

    held_from: the global id of the first expert of the tensors this rank holds: 0 for replicated
    experts (every rank holds all E), `local.start` for experts transformers' expert parallelism
    sharded by expert (each rank's DTensor parameters hold its local.stop - local.start experts;
    their local shards are read, never the DTensors, whose indexing would communicate)."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    n_local = len(local)
    # this rank holds every expert (world size 1): each id is its own sort key and every slot has
    # a row, so the held mask and its two selections are left out (the same keys, rows and map)
    whole = local.start == 0 and n_local == experts.gate_up_proj.shape[0]
    if whole:
        key = flat
    else:
        held = (flat >= local.start) & (flat < local.stop)
        # sort key: local expert index, or n_local for slots held elsewhere (sorted to the end)
        key = torch.where(held, flat - local.start, n_local)
    sorted_key, order = torch.sort(key, stable=True)  # permuted row p holds slot order[p]
    row_of_slot = torch.empty(order.shape, dtype=torch.int32, device=x.device)
    row_of_slot[order] = _positions(order.numel(), x.device)
    index_map = (row_of_slot if whole else torch.where(held, row_of_slot, -1)).view(tokens, top_k)
    # each local expert's cumulative row end, read off the sorted keys without a host sync (one
    # launch; a bincount would sync for its output size)
    ends = torch.searchsorted(sorted_key, _group_bounds(n_local, x.device), out_int32=True)
    rows = x[order // top_k]
    transposed = bool(getattr(experts, "is_transposed", False))
    held_experts = slice(local.start - held_from, local.stop - held_from)
    gate_up = _in_out(_local(experts.gate_up_proj)[held_experts], transposed)
    down = _in_out(_local(experts.down_proj)[held_experts], transposed)
    biased = bool(getattr(experts, "has_bias", False))
    if biased:  # each row's expert's biases (rows held elsewhere: any expert, never read)
        expert_of_row = sorted_key.clamp(max=n_local - 1)
    projected = _grouped_linear(rows, gate_up, ends)
    if biased:
        projected.add_(_local(experts.gate_up_proj_bias)[held_experts][expert_of_row])
    hidden = experts._apply_gate(projected)
    out = _grouped_linear(hidden, down, ends)
    if biased:
        out.add_(_local(experts.down_proj_bias)[held_experts][expert_of_row])
    return out, index_map


def shared_width(shared: torch.nn.Module) -> int:
    """The shared expert MLP's intermediate size I (gate/up/down, fused gate_up/down or fused
    input/output)."""
    if hasattr(shared, "gate_proj"):
        return shared.gate_proj.weight.shape[0]
    return _fused(shared)[1].weight.shape[1]


def _fused(shared: torch.nn.Module):
    """(the fused [2I, H] gate-and-up linear, the down linear) of a fused shared MLP."""
    if hasattr(shared, "gate_up_proj"):
        return shared.gate_up_proj, shared.down_proj
    return shared.input_linear, shared.output_linear


def shared_partial(
    x: torch.Tensor, shared: torch.nn.Module, columns: range, act=None
) -> torch.Tensor:
    """This rank's partial sum of the shared expert MLP on x [T, H]: its intermediate columns of
    gate_proj / up_proj (or of the gate and up halves of a fused gate_up_proj / input_linear
    [2I, H]), the matching input columns of down_proj (output_linear). act(shared, gate, up): the
    MLP's own activation where it is not act_fn(gate) * up (elementwise, so exact per column).
    A shared expert sharded by transformers' TP plan holds DTensor weights: its local shards are
    read (columns index them), so its modules' own forwards, and their all-reduce, never run.
    -> [T, H] x.dtype."""
    sl = slice(columns.start, columns.stop)
    if hasattr(shared, "gate_proj"):
        gate = F.linear(x, local(shared.gate_proj.weight)[sl])
        up = F.linear(x, local(shared.up_proj.weight)[sl])
        down = local(shared.down_proj.weight)
    else:
        fused, down_linear = _fused(shared)
        width = shared_width(shared)
        gate = F.linear(x, fused.weight[sl])
        up = F.linear(x, fused.weight[width + columns.start : width + columns.stop])
        down = down_linear.weight
    if act is not None:
        hidden = act(shared, gate, up)
    else:
        hidden = getattr(shared, "act_fn", None) or shared.activation
        hidden = hidden(gate) * up
    return F.linear(hidden, down[:, sl])
