"""Host side of the world-size-1 kernels (kernels/row_epilogue.py): the launch shape per T, and
`Tp1Dispatcher`, which decides a call's launch once per T and then launches with the cached
launcher (kernels/launch_cache.py), so an eager call is the argument tuple and one launch.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import triton

from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.pdl import PDL_OPTIONS, pdl_ok
from fusion_bridge.kernels.quant import (
    QUANT_FP8,
    QUANT_NVFP4,
    recip_ok,
    row_block,
    sf_padding_items,
)
from fusion_bridge.kernels.records import RowForm, RowOutputs, RowSource
from fusion_bridge.kernels.tp1.shapes import (  # noqa: F401 (limits and phase bits: re-exported)
    BOTH_PHASES,
    MAX_CHUNKS,
    MAX_POLLS,
    OUTPUT_PHASE,
    PUBLISH_PHASE,
    SYNC_ROWS,
    SYNC_WORDS,
    SplitSync,
    Tp1Shape,
    split_ok,
    tp1_shape,
)
from fusion_bridge.kernels.tp1.split_rows import _tp1_split_kernel
from fusion_bridge.kernels.tp1.whole_rows import _tp1_kernel


class WholeRows(NamedTuple):
    """The whole-row kernel's constexprs, by name (`whole_rows._tp1_kernel`)."""

    FORM: RowForm
    PREFETCH: int
    RECIP: int
    USE_PDL: int


class SplitRows(NamedTuple):
    """The split-row kernel's constexprs, by name (`split_rows._tp1_split_kernel`)."""

    FORM: RowForm
    CHUNK: int
    PREFETCH: int
    RECIP: int
    USE_PDL: int
    MAX_POLLS: int
    PHASES: int


_WHOLE_ROWS = KernelLauncher(_tp1_kernel, WholeRows._fields)
# whole rows in 16 warps: registers capped at 64 so that two programs always share an SM (every
# quant compiles to at most 64 uncapped today: the cap guards against a later change's registers)
_WHOLE_ROWS_CAPPED = KernelLauncher(_tp1_kernel, WholeRows._fields, options={"maxnreg": 64})
_SPLIT = KernelLauncher(_tp1_split_kernel, SplitRows._fields)
# the same kernels launched with programmatic dependent launch (kernels/pdl.py): compile options
# are fixed per launcher, and USE_PDL (a constexpr of the key) is True exactly on these
_WHOLE_ROWS_PDL = KernelLauncher(_tp1_kernel, WholeRows._fields, options=PDL_OPTIONS)
_WHOLE_ROWS_CAPPED_PDL = KernelLauncher(
    _tp1_kernel, WholeRows._fields, options={"maxnreg": 64} | PDL_OPTIONS
)
_SPLIT_PDL = KernelLauncher(_tp1_split_kernel, SplitRows._fields, options=PDL_OPTIONS)


GRAPH_WORDS = "graph"  # the key of the one set every CUDA-graph capture uses


class Tp1Dispatcher:
    """World-size-1 calls of one layer (`layer`: a `LayerRecord`): the launch per T (shape,
    grid, constants) is decided once and kept, so an eager call is the argument tuple and one
    cached launch.

    The split kernel's counters and tagged words: calls that share a set must not overlap. Eager
    calls get one zeroed set per CUDA stream (calls on one stream never overlap in their memory
    accesses: under PDL the next call's programs touch nothing before this call has completed).
    Calls captured in CUDA graphs all share one set, zeroed here, outside any capture: a set
    allocated during a capture would be zeroed only when the graph that captured it replays, so a
    graph replayed before it would read whatever the memory held. So graphs of one layer replay
    one at a time (as a model's forward does), never two at once on two streams.

    A split row whose partner programs never arrive (bounded wait) is written NaN and leaves an
    error word (pinned host memory, read with no device sync): `take_error` reports it once."""

    def __init__(self, layer, num_sms: int, device: torch.device):
        self.layer, self.num_sms, self.device = layer, num_sms, device
        # a shape's pdl is honoured only where the device has it (sm_90+, not the interpreter)
        self.pdl_ok = pdl_ok(device)
        self._plans: dict[tuple, tuple] = {}
        cuda = device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fused_tp1: build the bridge (prepare its strategies) before capturing a CUDA "
                "graph: its synchronization words must be zeroed outside any capture"
            )
        self._sync: dict[object, torch.Tensor] = {
            GRAPH_WORDS: torch.zeros(SYNC_WORDS, dtype=torch.int64, device=device)
        }
        self._error = torch.zeros(1, dtype=torch.int32)
        if cuda:
            self._error = self._error.pin_memory()
        # read through numpy (the same host memory): far cheaper than int(tensor[0]), on every
        # eager call's path (docs/performance.md#world-size-1-fused_tp1)
        self._error_word = self._error.numpy()
        # the kernel stores through this address (as the multi-rank kernels reach their pinned word)
        self.error_address = torch.tensor(
            [self._error.data_ptr()], dtype=torch.int64, device=device
        )

    def sync_words(self) -> torch.Tensor:
        """The split-kernel words of this call: the graphs' set while capturing, else the current
        stream's (allocated zeroed on first use)."""
        key = 0
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return self._sync[GRAPH_WORDS]
            key = torch._C._cuda_getCurrentRawStream(self.device.index or 0)
        got = self._sync.get(key)
        if got is None:
            got = torch.zeros(SYNC_WORDS, dtype=torch.int64, device=self.device)
            self._sync[key] = got
        return got

    def take_error(self) -> int:
        """The error word an earlier split launch left (0: none), cleared once read. Reads pinned
        host memory: no device sync, so a launch still in flight reports at a later call."""
        word = int(self._error_word[0])
        if word:
            self._error_word[0] = 0
        return word

    def plan(self, tokens: int, top_k: int, has_shared: bool, is_cuda: bool, sf_shape, shape):
        """(launcher, grid, constexprs, warps, split) of a call; shape None = `tp1_shape`."""
        key = (tokens, top_k, has_shared, is_cuda, sf_shape, shape)
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = self._make_plan(*key)
        return got

    def _make_plan(self, tokens, top_k, has_shared, is_cuda, sf_shape, shape):
        layer, quant = self.layer, self.layer.quant
        hidden = layer.hidden
        shape = shape or tp1_shape(tokens, hidden, quant.code, self.num_sms, quant.swizzled)
        nvfp4 = quant.code == QUANT_NVFP4
        # fp8 on a GPU: the division by the scale through one reciprocal (quant._div_by_scale)
        recip = int(is_cuda and quant.code == QUANT_FP8 and recip_ok(quant.scale))
        pdl = int(bool(shape.pdl) and is_cuda and self.pdl_ok)
        prefetch = int(shape.prefetch and is_cuda)
        form = RowForm(
            TOP_K=top_k,
            HAS_SHARED=has_shared,
            QUANT=quant.code,
            SWIZZLED=quant.swizzled,
            ROW_BLOCK=row_block(hidden),
            HW_CVT=is_cuda,
        )
        sf_rows, sf_cols = sf_shape if nvfp4 else (tokens, 0)
        if not split_ok(shape, tokens, hidden, self.num_sms):
            rows = sf_rows if nvfp4 and quant.swizzled else tokens
            fixed = WholeRows(FORM=form, PREFETCH=prefetch, RECIP=recip, USE_PDL=pdl)
            capped = shape.warps == 16
            if pdl:
                launcher = _WHOLE_ROWS_CAPPED_PDL if capped else _WHOLE_ROWS_PDL
            else:
                launcher = _WHOLE_ROWS_CAPPED if capped else _WHOLE_ROWS
            return launcher, (rows,), fixed, shape.warps, 0, sf_rows, sf_cols
        chunks = triton.cdiv(hidden, shape.columns)
        padding = sf_padding_items(tokens, sf_rows, sf_cols) if nvfp4 and quant.swizzled else 0
        fixed = SplitRows(
            FORM=form,
            CHUNK=shape.columns,
            PREFETCH=prefetch,
            RECIP=recip,
            USE_PDL=pdl,
            # the interpreter publishes every chunk before any wait: a few polls suffice there
            MAX_POLLS=MAX_POLLS if is_cuda else 4,
            PHASES=BOTH_PHASES,
        )
        return (
            _SPLIT_PDL if pdl else _SPLIT,
            (tokens * chunks + padding,),
            fixed,
            shape.warps,
            chunks,
            sf_rows,
            sf_cols,
        )

    def _launch_args(
        self,
        residual_out,
        norm_out,
        q,
        sf,
        gemm2_out,
        perm,
        weights,
        shared,
        residual,
        gamma,
        shape,
    ):
        """(launcher, grid, args, constexprs, warps, chunks) of one call."""
        tokens, top_k = perm.shape
        launcher, grid, fixed, warps, chunks, sf_rows, sf_cols = self.plan(
            tokens, top_k, shared is not None, residual.is_cuda, tuple(sf.shape), shape
        )
        src = RowSource(
            gemm2_out, perm, weights, residual if shared is None else shared, residual, gamma
        )
        out = RowOutputs(residual_out, norm_out, q, sf)
        hidden, scalars = self.layer.hidden, self.layer.scalars
        if not chunks:
            args = (src, out, tokens, hidden, scalars, sf_cols)
        else:
            sync = SplitSync(self.sync_words(), self.error_address)
            args = (src, out, sync, tokens, hidden, scalars, sf_rows, sf_cols, chunks)
        return launcher, grid, args, fixed, warps, chunks

    def __call__(
        self,
        residual_out: torch.Tensor,
        norm_out: torch.Tensor,
        q: torch.Tensor,
        sf: torch.Tensor,
        gemm2_out: torch.Tensor,
        perm: torch.Tensor,
        weights: torch.Tensor,
        shared: Optional[torch.Tensor],
        residual: torch.Tensor,
        gamma: torch.Tensor,
        *,
        shape: Optional[Tp1Shape] = None,
    ) -> None:
        """One call: residual_out, norm_out [T, H] (activation dtype); q, sf uint8 ([T, H] fp8
        codes / [T, H/2] packed fp4 and the nvfp4 scales; any tensor when unused); gemm2_out
        [P, H], perm [T, K] int32, weights [T, K], shared [T, H] or None, residual [T, H], gamma
        [H]. T == 0 launches nothing."""
        if perm.shape[0] == 0:
            return
        launcher, grid, args, fixed, warps, chunks = self._launch_args(
            residual_out, norm_out, q, sf, gemm2_out, perm, weights, shared, residual, gamma, shape
        )
        if not chunks or residual.is_cuda:
            launcher(grid, args, fixed, warps)
        else:  # the interpreter runs programs one after another: publish all, then wait
            for phase in (PUBLISH_PHASE, OUTPUT_PHASE):
                launcher(grid, args, fixed._replace(PHASES=phase), warps)

    def bound(self, *tensors: torch.Tensor, shape: Optional[Tp1Shape] = None) -> Callable:
        """The call's bare launch with everything precomputed (`__call__`'s tensors, in its order):
        what an eager call is measured against (benchmarks). GPU only."""
        launcher, grid, args, fixed, warps, _ = self._launch_args(*tensors, shape)
        return lambda: launcher(grid, args, fixed, warps)


def launch(layer, shape: Optional[Tp1Shape] = None, **tensors) -> None:
    """One world-size-1 call in whole rows (`tensors`: `local_call`'s keywords), through a
    launcher made for it; the strategy keeps its `Tp1Dispatcher` instead."""
    Tp1Dispatcher(layer, 0, tensors["residual"].device)(**tensors, shape=shape)
