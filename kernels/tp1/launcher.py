"""Host side of the world-size-1 kernels (kernels/row_epilogue.py): `Tp1Launcher`, which decides
a call's launch once per T (its config: `configs.tp1_config`) and then launches with the cached
kernel launcher (kernels/launch_cache.py), so an eager call is the argument tuple and one launch.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import triton

from fusion_bridge.kernels.bound_launch import BoundLaunch
from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.pdl import PDL_OPTIONS, pdl_ok
from fusion_bridge.kernels.quant import (
    QUANT_FP8,
    QUANT_NVFP4,
    recip_ok,
    row_block,
    sf_padding_items,
)
from fusion_bridge.kernels.quant_codes import QUANT_FP8_TOKEN, dynamic_scale_dims, is_dynamic
from fusion_bridge.kernels.records import RowForm, RowOutputs, RowSource
from fusion_bridge.kernels.tp1.configs import (  # noqa: F401 (limits and phase bits: re-exported)
    AMAX_PHASE,
    AMAX_WORDS,
    BOTH_PHASES,
    MAX_CHUNKS,
    MAX_POLLS,
    OUTPUT_PHASE,
    PUBLISH_PHASE,
    SYNC_ROWS,
    SYNC_WORDS,
    SplitSync,
    Tp1Config,
    dynamic_splits,
    split_ok,
    tp1_config,
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


class Tp1Plan(NamedTuple):
    """A call's launch, decided once per key (`Tp1Launcher.plan`): the config it follows, the
    kernel's cached launcher (kernels/launch_cache.py), grid, constexprs (`WholeRows` /
    `SplitRows`), warps, chunks per row (0: whole rows), the NVFP4 scales' rows and columns
    (T and 0 without NVFP4), and `launch`: the same launch with everything but the call's records
    bound (`bound_launch.BoundLaunch`), called as `launch(src, out)` (whole rows) or
    `launch(src, out, sync)` (split rows)."""

    config: Tp1Config
    kernel: KernelLauncher
    grid: tuple
    constexprs: Any
    warps: int
    chunks: int
    sf_rows: int
    sf_cols: int
    launch: BoundLaunch


class Tp1Launcher:
    """World-size-1 calls of one layer (`layer`: a `LayerRecord`; the verbs of
    `layer.FamilyLauncher`): the launch per T (config, grid, constants) is decided once and kept,
    so an eager call is the argument tuple and one cached launch.

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
        # a config's pdl is honoured only where the device has it (sm_90+, not the interpreter)
        self.pdl_ok = pdl_ok(device)
        self._plans: dict[tuple, Tp1Plan] = {}
        cuda = device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fused_tp1: build the bridge (prepare its strategies) before capturing a CUDA "
                "graph: its synchronization words must be zeroed outside any capture"
            )
        # per token's split rows exchange their chunk amaxes too: words after the sums
        per_token = layer.quant.code == QUANT_FP8_TOKEN
        self.words = SYNC_WORDS + (AMAX_WORDS if per_token else 0)
        # the interpreter's launches of a split call, one phase each (programs run one by one)
        self.phases = (PUBLISH_PHASE, AMAX_PHASE, OUTPUT_PHASE) if per_token else (
            PUBLISH_PHASE, OUTPUT_PHASE)  # fmt: skip
        self._sync: dict[object, torch.Tensor] = {
            GRAPH_WORDS: torch.zeros(self.words, dtype=torch.int64, device=device)
        }
        self._split_sync: dict[object, SplitSync] = {}  # the record of each set, built once
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

    def _sync_key(self) -> object:
        """Which set of words this call uses: the graphs' while capturing, else the current
        stream's (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        if torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda.is_current_stream_capturing
            return GRAPH_WORDS
        return torch._C._cuda_getCurrentRawStream(self.device.index or 0)

    def sync_words(self) -> torch.Tensor:
        """The split-kernel words of this call (int64 [self.words]: SYNC_WORDS, per token
        AMAX_WORDS more): the graphs' set while capturing, else the current stream's (allocated
        zeroed on first use)."""
        key = self._sync_key()
        got = self._sync.get(key)
        if got is None:
            got = torch.zeros(self.words, dtype=torch.int64, device=self.device)
            self._sync[key] = got
        return got

    def split_sync(self) -> SplitSync:
        """The split kernel's record of this call: `sync_words()` and the error word's address,
        built once per set of words."""
        key = self._sync_key()
        got = self._split_sync.get(key)
        if got is None:
            got = self._split_sync[key] = SplitSync(self.sync_words(), self.error_address)
        return got

    def take_error(self) -> int:
        """The error word an earlier split launch left (0: none), cleared once read. Reads pinned
        host memory: no device sync, so a launch still in flight reports at a later call."""
        word = int(self._error_word[0])
        if word:
            self._error_word[0] = 0
        return word

    def config_for(self, tokens: int) -> Tp1Config:
        """The config of a call of T tokens that names none (`configs.tp1_config` with this
        launcher's layer and SM count): the one rule, which tests and benchmarks read here."""
        quant = self.layer.quant
        return tp1_config(
            tokens, self.layer.hidden, quant.code, self.num_sms, quant.swizzled, quant.group
        )

    def plan(
        self,
        tokens: int,
        top_k: int,
        has_shared: bool,
        is_cuda: bool,
        sf_dims: tuple,
        config: Optional[Tp1Config] = None,
    ) -> Tp1Plan:
        """The launch of a call (kept per key); sf_dims: the NVFP4 scales' dimensions (sf.shape);
        config None: `config_for(tokens)`."""
        key = (tokens, top_k, has_shared, is_cuda, sf_dims, config)
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = self._make_plan(*key)
        return got

    def _make_plan(self, tokens, top_k, has_shared, is_cuda, sf_dims, config) -> Tp1Plan:
        layer, quant = self.layer, self.layer.quant
        hidden = layer.hidden
        config = config or self.config_for(tokens)
        nvfp4 = quant.code == QUANT_NVFP4
        # fp8 on a GPU: the division by the scale through one reciprocal (quant._div_by_scale)
        recip = int(is_cuda and quant.code == QUANT_FP8 and recip_ok(quant.scale))
        pdl = int(bool(config.pdl) and is_cuda and self.pdl_ok)
        prefetch = int(config.prefetch and is_cuda)
        form = RowForm(
            TOP_K=top_k,
            HAS_SHARED=has_shared,
            QUANT=quant.code,
            SWIZZLED=quant.swizzled,
            ROW_BLOCK=row_block(hidden),
            HW_CVT=is_cuda,
        )
        sf_rows, sf_cols = sf_dims if nvfp4 else (tokens, 0)
        dynamic = is_dynamic(quant.code)
        if dynamic:  # sf_rows: rows with scales (TMA padding too), sf_cols: the scales' stride
            form = form._replace(
                GROUP=quant.group or form.ROW_BLOCK, SCALE_LAYOUT=quant.scale_layout
            )
            sf_rows, sf_cols = dynamic_scale_dims(tokens, hidden, quant.group, quant.scale_layout)
        if not split_ok(config, tokens, hidden, self.num_sms) or not dynamic_splits(
            quant.code, quant.group, config.columns
        ):
            rows = sf_rows if (nvfp4 and quant.swizzled) or dynamic else tokens
            fixed = WholeRows(FORM=form, PREFETCH=prefetch, RECIP=recip, USE_PDL=pdl)
            capped = config.warps == 16
            if pdl:
                kernel = _WHOLE_ROWS_CAPPED_PDL if capped else _WHOLE_ROWS_PDL
            else:
                kernel = _WHOLE_ROWS_CAPPED if capped else _WHOLE_ROWS
            grid, sizes = (rows,), (tokens, hidden, layer.scalars, sf_cols)
            bound = BoundLaunch(kernel, grid, fixed, config.warps, sizes)
            return Tp1Plan(config, kernel, grid, fixed, config.warps, 0, sf_rows, sf_cols, bound)
        chunks = triton.cdiv(hidden, config.columns)
        padding = sf_padding_items(tokens, sf_rows, sf_cols) if nvfp4 and quant.swizzled else 0
        padding = sf_rows - tokens if dynamic else padding  # TMA scale padding rows
        fixed = SplitRows(
            FORM=form,
            CHUNK=config.columns,
            PREFETCH=prefetch,
            RECIP=recip,
            USE_PDL=pdl,
            # the interpreter publishes every chunk before any wait: a few polls suffice there
            MAX_POLLS=MAX_POLLS if is_cuda else 4,
            PHASES=BOTH_PHASES,
        )
        grid = (tokens * chunks + padding,)
        kernel = _SPLIT_PDL if pdl else _SPLIT
        sizes = (tokens, hidden, layer.scalars, sf_rows, sf_cols, chunks)
        bound = BoundLaunch(kernel, grid, fixed, config.warps, sizes)
        return Tp1Plan(config, kernel, grid, fixed, config.warps, chunks, sf_rows, sf_cols, bound)

    def call_args(self, src: RowSource, out: RowOutputs, config: Optional[Tp1Config] = None):
        """(plan, the kernel's runtime arguments) of one call; T > 0."""
        tokens, top_k = src.perm.shape
        plan = self.plan(
            tokens, top_k, src.shared is not None, src.residual.is_cuda, out.sf.shape, config
        )
        src, hidden, scalars = src.for_kernel(), self.layer.hidden, self.layer.scalars
        if not plan.chunks:
            return plan, (src, out, tokens, hidden, scalars, plan.sf_cols)
        return plan, (src, out, self.split_sync(), tokens, hidden, scalars, plan.sf_rows,
                      plan.sf_cols, plan.chunks)  # fmt: skip

    def __call__(self, src: RowSource, out: RowOutputs, config: Optional[Tp1Config] = None) -> None:
        """One call: `src` (`RowSource.of(inputs)`: gemm2_out [P, H], perm [T, K] int32, weights
        [T, K], shared [T, H] or None, residual [T, H], gamma [H]) into `out` (residual_out,
        norm_out [T, H] in the activation dtype; q, sf uint8: [T, H] fp8 codes / [T, H/2] packed
        fp4 and the nvfp4 scales, any tensor when unused). T == 0 launches nothing."""
        tokens, top_k = src.perm.shape
        if tokens == 0:
            return
        is_cuda = src.residual.is_cuda
        # self.plan(...)'s lookup in place: the same key, made by plan() on a miss
        key = (tokens, top_k, src.shared is not None, is_cuda, out.sf.shape, config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self.plan(*key)
        # src.for_kernel(), in place (the kernel's record; plan and call_args read src itself)
        given = src
        if src.shared is None:
            given = RowSource(src.gemm2_out, src.perm, src.weights, src.residual, src.residual,
                              src.gamma)  # fmt: skip
        if not plan.chunks:  # the bound launch: the call's records, the rest bound per plan
            plan.launch(given, out)
        elif is_cuda:
            plan.launch(given, out, self.split_sync())
        else:  # the interpreter runs programs one after another: publish all, then wait
            plan, args = self.call_args(src, out, config)
            for phase in self.phases:
                plan.kernel(plan.grid, args, plan.constexprs._replace(PHASES=phase), plan.warps)

    def bound(
        self, src: RowSource, out: RowOutputs, config: Optional[Tp1Config] = None
    ) -> Callable[[], None]:
        """The call's bare launch with everything precomputed (its plan's bound launch, as a call
        makes it, with the records built once): what an eager call is measured against
        (benchmarks). GPU only; T > 0."""
        plan, args = self.call_args(src, out, config)
        lead = args[:3] if plan.chunks else args[:2]
        return lambda: plan.launch(*lead)
