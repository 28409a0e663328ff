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
from typing import Iterable, Optional

import torch

from fusion_bridge.call import custom_op
from fusion_bridge.epilogue_tensors import (
    EpilogueInputError,
    EpilogueInputs,
    EpilogueOutputs,
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


def _span(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """[first, last) byte addresses `t` may touch (its strides' reach), or None when empty."""
    if t.numel() == 0:
        return None
    reach = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (reach + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = _span(a), _span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


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
    given: list[tuple[str, torch.Tensor]] = []
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
        if name == "scale" and spec.quant.dynamic_fp8:
            _check_scale_view(spec, t, field)
        elif not t.is_contiguous():
            _fail(field, "contiguous", f"strides {t.stride()}")
        given.append((field, t))
    _refuse_overlaps(given, zip(inputs._fields, inputs))


def _check_scale_view(spec: EpilogueSpec, t: torch.Tensor, field: str) -> None:
    """A dynamic FP8 scale must be exactly the view `allocate_outputs` hands out in the spec's
    layout (its strides; docs/math.md section 3): row_major (G, 1); column_major (1, T);
    column_major_tma (1, round_up(T, 4)). Metadata only."""
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


def _refuse_overlaps(given: list[tuple[str, torch.Tensor]], inputs: Iterable) -> None:
    named_inputs = [(n, t) for n, t in inputs if isinstance(t, torch.Tensor)]
    for i, (field, t) in enumerate(given):
        for name, other in named_inputs:
            if _overlaps(t, other):
                _fail(
                    field,
                    f"memory of its own, sharing none with the input {name} (the inputs are "
                    "never modified; a failing call may write NaN rows into its outputs)",
                    f"a tensor overlapping {name}",
                )
        for other_field, other in given[:i]:
            if _overlaps(t, other):
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
_TAKES_OUT: dict[type, bool] = {}


def run_into(strategy, inputs: EpilogueInputs, variant: str, out: Optional[EpilogueOutputs]):
    """`strategy.run(inputs, variant)`, into `out` when given: passed through when its run takes
    `out` (every strategy here), else its outputs copied into it (`deliver`)."""
    if out is None:
        return strategy.run(inputs, variant)
    cls = type(strategy)
    takes = _TAKES_OUT.get(cls)
    if takes is None:
        takes = _TAKES_OUT[cls] = "out" in inspect.signature(strategy.run).parameters
    if takes:
        return strategy.run(inputs, variant, out=out)
    return deliver(out, strategy.run(inputs, variant))
