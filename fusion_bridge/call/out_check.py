"""The checks of a call's preallocated outputs (`finalize_epilogue(..., out=)`): metadata only (no
sync, no allocation), so a CUDA-graph capture may take them.

`out` must be an EpilogueOutputs of exactly the call's outputs (`allocate_outputs(spec, T, device)`
gives one: shapes, dtypes, device, contiguous; quant/scale where the spec quantizes, None where it
does not), and none of its tensors may share memory with an input or with another of its tensors:
the caller's inputs are never modified, and a failing call's protocol may write NaN rows into its
outputs (a residual_out over `residual` would lose the residual stream).
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Optional

import torch

from fusion_bridge.call import custom_op
from fusion_bridge.epilogue_tensors import (
    EpilogueInputError,
    EpilogueInputs,
    EpilogueOutputs,
    allocate_outputs,
    deliver,
)
from fusion_bridge.spec import (
    EpilogueSpec,
    QuantKind,
    ScaleLayout,
    fp8_scale_columns,
    fp8_scale_storage_shape,
    sf_shape,
)

OUT_FIELDS = ("residual_out", "norm_out", "quant", "scale")


def _fail(name: str, expected: str, actual: object) -> None:
    raise EpilogueInputError(f"finalize_epilogue: {name} must be {expected}, got {actual}")


def expected_outputs(
    spec: EpilogueSpec, tokens: int
) -> dict[str, Optional[tuple[tuple[int, ...], torch.dtype]]]:
    """Per field of EpilogueOutputs, (shape, dtype) a call of T tokens writes, or None where the
    spec has no such output (the shapes of `allocate_outputs`)."""
    hidden, kind = spec.hidden_size, spec.quant.kind
    row = ((tokens, hidden), spec.dtype)
    quant = scale = None
    if kind is QuantKind.FP8:
        quant = ((tokens, hidden), torch.float8_e4m3fn)
    elif kind is QuantKind.NVFP4:
        quant = ((tokens, hidden // 2), torch.uint8)
        scale = (tuple(sf_shape(tokens, hidden, spec.quant.sf_layout)), torch.uint8)
    elif spec.quant.dynamic_fp8:
        quant = ((tokens, hidden), torch.float8_e4m3fn)
        scale = ((tokens, fp8_scale_columns(hidden, spec.quant)), torch.float32)
    return {"residual_out": row, "norm_out": row, "quant": quant, "scale": scale}


def _span(t: torch.Tensor, extent: Optional[int] = None) -> Optional[tuple[int, int]]:
    """[first, last) byte addresses `t` may touch: its strides' reach, or `extent` elements from
    its first where its writer reaches further (a TMA scale's padding); None when empty."""
    if t.numel() == 0:
        return None
    if extent is None:
        extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _overlaps(
    a: torch.Tensor, b: torch.Tensor, a_extent: Optional[int] = None, b_extent: Optional[int] = None
) -> bool:
    """Whether a's and b's spans (`_span`, with each one's extent where given) share a byte."""
    if a.device != b.device:
        return False
    sa, sb = _span(a, a_extent), _span(b, b_extent)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def _padded_elements(spec: EpilogueSpec, tokens: int, groups: int) -> Optional[int]:
    """The elements from a dynamic FP8 scale's first that its writer reaches where that is more
    than the view's own reach: column_major_tma's storage [G, round_up(T, 4)], whose padding
    columns (rows T .. round_up(T, 4) of the view) the kernels zero, the last group's past the
    view's reach. None for the other layouts and T == 0 (the view's reach is all)."""
    if not tokens or spec.quant.scale_layout is not ScaleLayout.COLUMN_MAJOR_TMA:
        return None
    rows, width = fp8_scale_storage_shape(tokens, groups, ScaleLayout.COLUMN_MAJOR_TMA)
    return rows * width


def _held_elements(t: torch.Tensor) -> int:
    """The elements of t's storage from t's first on (what a writer past the view can reach)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def validate_out(
    spec: EpilogueSpec,
    inputs: EpilogueInputs,
    out: object,
    tokens: int,
    device: torch.device,
) -> None:
    """Raise EpilogueInputError naming the field, what it must be and what it is, unless `out` is
    an EpilogueOutputs of the call's T outputs on `device` that shares no memory with an input or
    with another of its own tensors. Metadata only: no sync, capture-safe."""
    if not isinstance(out, EpilogueOutputs):
        _fail("out", "an EpilogueOutputs (e.g. allocate_outputs(spec, T, device))", type(out))
    expected = expected_outputs(spec, tokens)
    given: list[tuple[str, torch.Tensor, Optional[int]]] = []
    for name in OUT_FIELDS:
        t, want = getattr(out, name), expected[name]
        field = f"out.{name}"
        if want is None:
            if t is not None:
                _fail(field, f"None (spec.quant.kind={spec.quant.kind.value!r})", type(t).__name__)
            continue
        shape, dtype = want
        if not isinstance(t, torch.Tensor):
            _fail(field, f"a torch.Tensor {list(shape)} {dtype}", type(t).__name__)
        if t.is_nested or t.layout is not torch.strided or t.is_neg() or t.is_conj():
            _fail(field, "a dense strided tensor whose memory holds its values", "a lazy view")
        if t.dtype != dtype:
            _fail(f"{field}.dtype", str(dtype), t.dtype)
        if tuple(t.shape) != tuple(shape):
            _fail(f"{field}.shape", str(list(shape)), list(t.shape))
        if t.device != device:
            _fail(f"{field}.device", str(device), t.device)
        extent = None
        if name == "scale" and spec.quant.dynamic_fp8:
            extent = _check_scale_view(spec, t, field)
        elif not t.is_contiguous():
            _fail(field, "contiguous", f"strides {t.stride()}")
        given.append((field, t, extent))
    _refuse_overlaps(given, zip(inputs._fields, inputs))


def output_check(
    spec: EpilogueSpec, device: torch.device
) -> Callable[[EpilogueInputs, object, int], bool]:
    """validate_out's checks as one function with the spec's values bound, for the hot path (as
    validation.input_check is for the inputs): `check(inputs, out, T)` is True only when `out`
    passes every check of validate_out; False on any mismatch (then call validate_out, which says
    what is wrong) and for T == 0 (validate_out decides). Metadata only: no sync, capture-safe.

    `inputs` must have passed the input checks (dense, contiguous, on `device`): each input's
    memory is then exactly [data_ptr, data_ptr + nbytes), what `_span` gives. Per T, each output's
    dtype, shape, strides (a dynamic FP8 scale's) and byte reach are read once from
    `allocate_outputs` on the meta device (the owner of the shapes `expected_outputs` states); an
    output that matches them reaches exactly [data_ptr, data_ptr + reach) (a column_major_tma
    scale: with its padding, `_padded_elements`), so the overlap check reads one address per
    output.

    Per output tensor: its dtype; its shape; contiguous (a dynamic FP8 scale: the layout's exact
    strides instead); not a negative view; on `device`. validate_out's other refusals follow from
    these: the conjugate bit exists on complex dtypes only (none is an output's); a tensor that is
    not dense and strided has no shape to read (nested), another shape (jagged), is not contiguous
    (sparse COO), raises on is_contiguous (compressed sparse) or on data_ptr (mkldnn), and a raise
    is a False (tests/call/test_output_check.py tries each layout). Then quant / scale None where
    the spec has none, a column_major_tma scale's storage holding its padding, and no output
    sharing memory with an input or with another output."""
    dtype = spec.dtype
    cuda_index = device.index if device.type == "cuda" else None
    layouts: dict[int, Optional[tuple]] = {}

    def layout(tokens: int) -> Optional[tuple]:
        """(row shape, row bytes, quant want, scale want) of T, each want (dtype, shape, bytes
        reached, strides or None: contiguous, elements its storage must hold from its first or
        None) or None where the spec has no such output; None (the slow path) when an output is
        empty (T == 0)."""
        probes = allocate_outputs(spec, tokens, torch.device("meta"))
        wants: list[Optional[tuple]] = []
        for name in OUT_FIELDS:
            probe = getattr(probes, name)
            if probe is None:
                wants.append(None)
                continue
            if probe.numel() == 0:
                return None
            reach = sum((size - 1) * stride for size, stride in zip(probe.shape, probe.stride()))
            strides = padded = None
            if name == "scale" and spec.quant.dynamic_fp8:
                # exactly its layout's strides, as _check_scale_view asks (even where
                # is_contiguous would hold: [T, 1], or T == 1 column-major); the TMA padding
                strides = probe.stride()
                padded = _padded_elements(spec, tokens, probe.shape[1])
            extent = reach + 1 if padded is None else padded
            size = probe.element_size()
            wants.append((probe.dtype, probe.shape, extent * size, strides, padded))
        return wants[0][1], wants[0][2], wants[2], wants[3]

    def check(inputs: EpilogueInputs, out: object, tokens: int) -> bool:
        try:
            if type(out) is not EpilogueOutputs:
                return False
            got = layouts.get(tokens, _UNSEEN)
            if got is _UNSEEN:
                if len(layouts) >= _MAX_LAYOUTS:  # T is the caller's: keep the dict bounded
                    layouts.clear()
                got = layouts[tokens] = layout(tokens)
            if got is None:
                return False
            row_shape, row_bytes, quant_want, scale_want = got
            r, n = out.residual_out, out.norm_out
            if not (
                r.dtype is dtype
                and n.dtype is dtype
                and r.shape == row_shape
                and n.shape == row_shape
                and r.is_contiguous()
                and n.is_contiguous()
                and not (r.is_neg() or n.is_neg())
                and (
                    r.get_device() == cuda_index and n.get_device() == cuda_index
                    if cuda_index is not None
                    else r.device == device and n.device == device
                )
            ):
                return False
            r0 = r.data_ptr()
            r1 = r0 + row_bytes
            n0 = n.data_ptr()
            n1 = n0 + row_bytes
            if r0 < n1 and n0 < r1:  # the rows share memory
                return False
            extra: list[tuple[int, int]] = []  # the spans of quant and scale
            for t, want in ((out.quant, quant_want), (out.scale, scale_want)):
                if want is None:
                    if t is not None:
                        return False
                    continue
                want_dtype, want_shape, reach, strides, padded = want
                if not (
                    t.dtype is want_dtype
                    and t.shape == want_shape
                    and (t.is_contiguous() if strides is None else t.stride() == strides)
                    and not t.is_neg()
                    and (
                        t.get_device() == cuda_index
                        if cuda_index is not None
                        else t.device == device
                    )
                ):
                    return False
                if padded is not None and _held_elements(t) < padded:
                    return False  # a TMA scale's storage holds its padding
                start = t.data_ptr()
                end = start + reach
                if (start < r1 and r0 < end) or (start < n1 and n0 < end):
                    return False
                for a, b in extra:
                    if a < end and start < b:
                        return False
                extra.append((start, end))
            for t in inputs:  # valid inputs: contiguous, so [data_ptr, data_ptr + nbytes)
                if t is not None:
                    size = t.nbytes
                    if size:
                        low = t.data_ptr()
                        high = low + size
                        if (r0 < high and low < r1) or (n0 < high and low < n1):
                            return False
                        for a, b in extra:
                            if a < high and low < b:
                                return False
            return True
        except Exception:  # noqa: BLE001 - not a tensor, an exotic layout: validate_out says what
            return False

    return check


_UNSEEN = object()
_MAX_LAYOUTS = 4096  # distinct T kept by one output_check (each a few small tuples)


def _check_scale_view(spec: EpilogueSpec, t: torch.Tensor, field: str) -> Optional[int]:
    """A dynamic FP8 scale must be exactly the view `allocate_outputs` hands out in the spec's
    layout (its strides; docs/math.md section 3): row_major (G, 1); column_major (1, T);
    column_major_tma (1, round_up(T, 4)), over a storage that holds the padding columns the
    writer zeroes. Returns the elements the writer reaches from the view's first where that is
    more than the view's reach (`_padded_elements`), else None. Metadata only."""
    tokens, groups = t.shape
    layout = spec.quant.scale_layout or ScaleLayout.ROW_MAJOR
    storage = fp8_scale_storage_shape(tokens, groups, layout)
    want = (groups, 1) if layout is ScaleLayout.ROW_MAJOR else (1, storage[1])
    if tokens and t.stride() != want:
        _fail(
            field,
            f"the {layout.value} layout's view, strides {want} (fp32 storage {list(storage)}"
            f"{'' if layout is ScaleLayout.ROW_MAJOR else ', handed out as its transpose'})",
            f"strides {t.stride()}",
        )
    padded = _padded_elements(spec, tokens, groups)
    if padded is not None:
        held = _held_elements(t)
        if held < padded:
            _fail(
                field,
                f"a view whose storage holds the layout's padding: {padded} fp32 elements from "
                f"its first (storage {list(storage)}, as allocate_outputs makes it; the kernels "
                "zero the padding columns)",
                f"a storage of {held} elements from it",
            )
    return padded


def _refuse_overlaps(
    given: list[tuple[str, torch.Tensor, Optional[int]]], inputs: Iterable
) -> None:
    named_inputs = [(n, t) for n, t in inputs if isinstance(t, torch.Tensor)]
    for i, (field, t, extent) in enumerate(given):
        for name, other in named_inputs:
            if _overlaps(t, other, extent):
                _fail(
                    field,
                    f"memory of its own, sharing none with the input {name} (the inputs are "
                    "never modified; a failing call may write NaN rows into its outputs)",
                    f"a tensor overlapping {name}",
                )
        for other_field, other, other_extent in given[:i]:
            if _overlaps(t, other, extent, other_extent):
                _fail(field, f"memory of its own, sharing none with {other_field}", "an overlap")


def compiled_call(
    spec: EpilogueSpec, name: str, out: Optional[EpilogueOutputs], *tensors: tuple
) -> EpilogueOutputs:
    """Under torch.compile: the bridge `name`'s call as its one opaque custom op (call/custom_op.py,
    run eagerly), on the six input `tensors` (given in two tuples); its outputs copied into `out`
    when given (shapes, dtypes and presence checked against the op's; fake tensors have no
    addresses, so the overlap check is left to the eager call)."""
    inputs = [t for part in tensors for t in part]
    result = custom_op.outputs_from_op(
        spec, torch.ops.fusion_bridge.finalize_epilogue(*inputs, name)
    )
    if out is None:
        return result
    if not isinstance(out, EpilogueOutputs):
        _fail("out", "an EpilogueOutputs (e.g. allocate_outputs(spec, T, device))", type(out))
    for name in OUT_FIELDS:
        t, want = getattr(out, name), getattr(result, name)
        if (t is None) != (want is None):
            _fail(f"out.{name}", "None" if want is None else "a tensor", type(t).__name__)
        if t is not None and (t.shape != want.shape or t.dtype != want.dtype):
            _fail(f"out.{name}", f"{list(want.shape)} {want.dtype}", f"{list(t.shape)} {t.dtype}")
    return deliver(out, result)


#: strategy class -> whether its run() takes `out` (a strategy written before `out=` existed, e.g.
#: a third party's, does not: its outputs are copied into `out`)
TAKES_OUT: dict[type, bool] = {}


def run_into(strategy, inputs: EpilogueInputs, variant: str, out: Optional[EpilogueOutputs]):
    """`strategy.run(inputs, variant)`, into `out` when given: passed through when its run takes
    `out` (every strategy here), else its outputs copied into it (`deliver`)."""
    if out is None:
        return strategy.run(inputs, variant)
    cls = type(strategy)
    takes = TAKES_OUT.get(cls)
    if takes is None:
        takes = TAKES_OUT[cls] = "out" in inspect.signature(strategy.run).parameters
    if takes:
        return strategy.run(inputs, variant, out=out)
    return deliver(out, strategy.run(inputs, variant))
