"""The out= fast check (`call/out_check.py`'s `output_check`, the bridge's `_out_looks_valid`,
issue 50 round three): it is True only where `validate_out` accepts, so every refusal of
`validate_out` is a False of the fast check (the bridge then calls `validate_out`, which raises
naming the field), and it is True for the outputs `allocate_outputs` gives (the common call never
pays `validate_out`). Each case below is checked on both: the fast check's answer and
`validate_out`'s refusal naming the field."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.call.out_check import output_check, validate_out
from fusion_bridge.epilogue_tensors import EpilogueInputError, EpilogueOutputs, allocate_outputs
from fusion_bridge.oracle.synthetic import make_inputs

CPU = torch.device("cpu")
QUANTS = {
    "none": QuantSpec.none(),
    "fp8": QuantSpec.fp8(0.5),
    "nvfp4_swizzled": QuantSpec.nvfp4(448.0),
    "nvfp4_linear": QuantSpec.nvfp4(448.0, "linear"),
    "group_row_major": QuantSpec.fp8_per_token_group(16, "row_major"),
    "group_column_major": QuantSpec.fp8_per_token_group(16, "column_major"),
    "group_column_major_tma": QuantSpec.fp8_per_token_group(16, "column_major_tma"),
    "per_token": QuantSpec.fp8_per_token(),
}
T = 5


def _spec(quant: str, shared: bool = True) -> EpilogueSpec:
    return EpilogueSpec(hidden_size=64, top_k=2, quant=QUANTS[quant], has_shared_output=shared)


def _refused(spec, inp, out, tokens=T) -> str:
    """validate_out's message (it must raise)."""
    with pytest.raises(EpilogueInputError) as info:
        validate_out(spec, inp, out, tokens, CPU)
    return str(info.value)


def _fields(out: EpilogueOutputs) -> list[str]:
    return [
        f for f in ("residual_out", "norm_out", "quant", "scale") if getattr(out, f) is not None
    ]


@pytest.mark.parametrize("tokens", [1, T, 130])  # 130: NVFP4's swizzled scales pad past 128 rows
@pytest.mark.parametrize("quant", list(QUANTS))
def test_the_outputs_allocate_outputs_gives_pass_the_fast_check(quant, tokens):
    spec = _spec(quant)
    check = output_check(spec, CPU)
    inp = make_inputs(spec, tokens, seed=1)
    out = allocate_outputs(spec, tokens, CPU)
    assert check(inp, out, tokens)
    validate_out(spec, inp, out, tokens, CPU)  # and validate_out agrees
    assert check(inp, out, tokens)  # the second call: T's kept layout


def _wrong_versions(spec, out: EpilogueOutputs, field: str) -> dict[str, object]:
    """{what is wrong: a value for `field`} that validate_out refuses."""
    t = getattr(out, field)
    other_dtype = torch.float32 if t.dtype != torch.float32 else torch.bfloat16
    longer = torch.empty(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
    transposed = torch.empty(t.shape[::-1], dtype=t.dtype).t()
    wrong = {
        "dtype": torch.empty_strided(t.shape, t.stride(), dtype=other_dtype),
        "shape": longer,
        "device": torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
        "negative view": torch._neg_view(t),
        "not a tensor": t.tolist() if t.dtype != torch.float8_e4m3fn else [[0.0]],
        "missing": None,
    }
    if t.is_contiguous():  # a transposed view of the same shape
        wrong["not contiguous"] = transposed
    else:  # a dynamic FP8 scale in another layout's view: the right values in contiguous memory
        wrong["another layout's view"] = t.contiguous()
    if t.dim() == 2 and t.shape[1] == 1:  # [T, 1]: contiguous whatever its stride on dim 1
        wrong["odd stride on a size-1 dim"] = torch.empty(T, 2, dtype=t.dtype)[:, :1]
    return wrong


@pytest.mark.parametrize("quant", list(QUANTS))
def test_each_refusal_of_a_field_is_a_false_of_the_fast_check(quant):
    spec = _spec(quant)
    check = output_check(spec, CPU)
    inp = make_inputs(spec, T, seed=2)
    good = allocate_outputs(spec, T, CPU)
    tried = 0
    for field in _fields(good):
        for what, value in _wrong_versions(spec, good, field).items():
            if what == "odd stride on a size-1 dim" and value.is_contiguous() is False:
                continue
            bad = dataclasses.replace(good, **{field: value})
            if what == "odd stride on a size-1 dim" and not spec.quant.dynamic_fp8:
                validate_out(spec, inp, bad, T, CPU)  # contiguous: accepted by both
                assert check(inp, bad, T), (field, what)
                continue
            assert not check(inp, bad, T), (field, what)
            assert f"out.{field}" in _refused(spec, inp, bad), (field, what)
            tried += 1
    assert tried >= 12
    # a quant or scale where the spec has none
    extra = [f for f in ("quant", "scale") if getattr(good, f) is None]
    for field in extra:
        bad = dataclasses.replace(good, **{field: torch.empty(T, 64, dtype=torch.uint8)})
        assert not check(inp, bad, T), field
        assert f"out.{field} must be None" in _refused(spec, inp, bad)


def test_an_object_with_the_fields_that_is_not_epilogue_outputs_is_refused():
    spec = _spec("none")
    check = output_check(spec, CPU)
    inp = make_inputs(spec, T, seed=3)
    good = allocate_outputs(spec, T, CPU)
    lookalike = types.SimpleNamespace(**dataclasses.asdict(good))
    assert not check(inp, lookalike, T)
    assert "out must be an EpilogueOutputs" in _refused(spec, inp, lookalike)
    assert not check(inp, (good.norm_out, good.residual_out), T)


def _other_layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`t`'s values in every non-strided layout this torch builds (sparse, mkldnn, nested)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR / nested: "beta" / "prototype" warnings
        got = {
            "sparse_coo": t.to_sparse(),
            "sparse_csr": t.to_sparse_csr(),
            "sparse_csc": t.to_sparse_csc(),
            "sparse_bsr": t.to_sparse_bsr((1, 1)),
            "nested": torch.nested.nested_tensor(list(t)),
            "jagged": torch.nested.nested_tensor(list(t), layout=torch.jagged),
        }
        try:
            got["mkldnn"] = t.to_mkldnn()
        except RuntimeError:  # a build without mkldnn
            pass
    return got


def test_a_field_in_a_layout_that_is_not_dense_and_strided_is_refused():
    """The fast check reads no layout: each non-strided layout fails its shape, contiguity or
    address read (output_check's docstring); validate_out names it."""
    spec = _spec("none")
    check = output_check(spec, CPU)
    inp = make_inputs(spec, T, seed=4)
    good = allocate_outputs(spec, T, CPU)
    layouts = _other_layouts(torch.zeros(T, 64, dtype=torch.bfloat16))
    assert len(layouts) >= 6
    for name, value in layouts.items():
        for field in ("residual_out", "norm_out"):
            bad = dataclasses.replace(good, **{field: value})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert not check(inp, bad, T), (name, field)
            assert f"out.{field}" in _refused(spec, inp, bad), (name, field)


def test_the_layout_kept_per_t_is_t_s():
    """Calls of several T on one check: each T's outputs pass at their T only."""
    spec = _spec("nvfp4_swizzled")
    check = output_check(spec, CPU)
    outs = {t: allocate_outputs(spec, t, CPU) for t in (1, T, 200)}
    inps = {t: make_inputs(spec, t, seed=t) for t in outs}
    for t in outs:
        assert check(inps[t], outs[t], t)
    for t in outs:
        for other in outs:
            if other != t:
                assert not check(inps[t], outs[other], t), (t, other)
    assert not check(make_inputs(spec, 0), allocate_outputs(spec, 0, CPU), 0)  # T == 0: slow path


# ---------------------------------------------------------------- shared memory


def _reach(t: torch.Tensor) -> int:
    """Bytes from t's first element to the end of its last."""
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _written(t: torch.Tensor) -> int:
    """Bytes from t's first element that a kernel writing it reaches: its reach, and for a
    column_major_tma scale (fp32 [T, G], strides (1, round_up(T, 4)), storage [G, round_up(T, 4)]
    whose padding columns the kernels zero) the whole storage: G * round_up(T, 4) elements."""
    tma = t.dim() == 2 and t.dtype == torch.float32 and t.stride(0) == 1 and t.shape[1] > 1
    return t.shape[1] * t.stride(1) * 4 if tma else _reach(t)


class _Arena:
    """Tensors carved from one byte buffer at chosen offsets (so their memory can be placed next
    to or over each other's); every offset a multiple of 16 apart from the ones a case moves."""

    def __init__(self, sizes: int):
        self.buffer = torch.zeros(sizes, dtype=torch.uint8)

    def at(self, like: torch.Tensor, offset: int) -> torch.Tensor:
        assert offset % like.element_size() == 0 and offset >= 0
        t = torch.empty(0, dtype=like.dtype)
        return t.set_(self.buffer.untyped_storage(), offset // like.element_size(),
                      like.shape, like.stride())  # fmt: skip


def _laid_out(spec, tokens: int):
    """(arena, inputs, outputs): every input and output of T in one arena, in that order,
    `gap` bytes apart (more than any of them reaches, so a tensor moved next to one touches no
    other)."""
    inp = make_inputs(spec, tokens, seed=6)
    out = allocate_outputs(spec, tokens, CPU)
    tensors = [t for t in inp if t is not None] + [getattr(out, f) for f in _fields(out)]
    gap = (max(_written(t) for t in tensors) + 64) // 16 * 16
    arena = _Arena(gap * (2 * len(tensors) + 4))
    offset, placed = gap, []
    for t in tensors:
        placed.append(arena.at(t, offset))
        offset += 2 * gap
    inputs = inp._replace(**{n: placed.pop(0) for n in inp._fields if getattr(inp, n) is not None})
    outputs = dataclasses.replace(out, **dict(zip(_fields(out), placed)))
    return arena, inputs, outputs


def _beside(arena, t: torch.Tensor, target: torch.Tensor, where: str) -> torch.Tensor:
    """A tensor like `t` placed against `target`'s memory: "before" ending where it starts, "after"
    starting where it ends (adjacent, no byte shared), or overlapping it by one element of `t` at
    its "first" or "last" byte."""
    base = arena.buffer.data_ptr()
    start, size, reach = target.data_ptr() - base, _written(target), _written(t)
    item = t.element_size()
    offset = {
        "before": start - reach,
        "first": start - reach + item,
        "after": start + size,
        "last": start + size - item,
    }[where]
    offset = offset // item * item if where in ("after", "before") else offset
    if where == "after" and offset < start + size:
        offset += item  # rounded up to t's alignment: still no byte shared
    return arena.at(t, offset)


SHARING = ["none", "nvfp4_swizzled", "group_column_major_tma", "per_token"]


@pytest.mark.parametrize("quant", SHARING)
def test_an_output_over_any_input_by_one_element_is_refused_and_one_beside_it_passes(quant):
    spec = _spec(quant)
    check = output_check(spec, CPU)
    arena, inp, out = _laid_out(spec, T)
    assert check(inp, out, T)
    validate_out(spec, inp, out, T, CPU)
    for field in _fields(out):
        for name in inp._fields:
            target = getattr(inp, name)
            if target is None:
                continue
            for where in ("before", "first", "after", "last"):
                moved = dataclasses.replace(
                    out, **{field: _beside(arena, getattr(out, field), target, where)}
                )
                if where in ("before", "after"):
                    validate_out(spec, inp, moved, T, CPU)  # adjacent: accepted by both
                    assert check(inp, moved, T), (field, name, where)
                else:
                    assert not check(inp, moved, T), (field, name, where)
                    msg = _refused(spec, inp, moved)
                    assert f"out.{field}" in msg and name in msg, (field, name, where, msg)


@pytest.mark.parametrize("quant", SHARING)
def test_outputs_over_each_other_by_one_element_are_refused(quant):
    spec = _spec(quant, shared=False)  # shared_output None: skipped by both
    check = output_check(spec, CPU)
    arena, inp, out = _laid_out(spec, T)
    assert inp.shared_output is None and check(inp, out, T)
    fields = _fields(out)
    for i, field in enumerate(fields):
        for other in fields[:i] + fields[i + 1 :]:
            for where in ("before", "first", "after", "last"):
                placed = _beside(arena, getattr(out, field), getattr(out, other), where)
                moved = dataclasses.replace(out, **{field: placed})
                if where in ("before", "after"):
                    validate_out(spec, inp, moved, T, CPU)
                    assert check(inp, moved, T), (field, other, where)
                else:
                    assert not check(inp, moved, T), (field, other, where)
                    assert "memory of its own" in _refused(spec, inp, moved)


def test_a_tma_scale_reaches_its_padding_columns():
    """A column_major_tma scale's view reaches (T - 1) + (G - 1) * round_up(T, 4) + 1 elements,
    more than its T * G, and the kernels also zero its padding columns, the last group's past that
    reach (G * round_up(T, 4) elements in all): an input inside either part is refused; so is a
    scale whose storage ends before its padding (the kernels would write past it)."""
    spec = _spec("group_column_major_tma")
    check = output_check(spec, CPU)
    arena, inp, out = _laid_out(spec, T)
    scale = out.scale
    numel_end = scale.numel() * scale.element_size()
    assert numel_end < _reach(scale) < _written(scale)
    base = scale.data_ptr() - arena.buffer.data_ptr()
    for offset in (numel_end, _reach(scale), _written(scale) - 4):  # from the scale's first byte
        gamma = arena.at(inp.gamma, base + offset // 4 * 4)
        moved = inp._replace(gamma=gamma)
        assert not check(moved, out, T), offset
        msg = _refused(spec, moved, out)
        assert "out.scale" in msg and "gamma" in msg, (offset, msg)
    beside = inp._replace(gamma=arena.at(inp.gamma, base + _written(scale)))
    validate_out(spec, beside, out, T, CPU)
    assert check(beside, out, T)
    # the same view over a storage that ends where the view's reach does: no room for the padding
    short = torch.empty(0, dtype=torch.float32).set_(
        torch.empty(_reach(scale) // 4, dtype=torch.float32).untyped_storage(),
        0,
        scale.shape,
        scale.stride(),
    )
    bad = dataclasses.replace(out, scale=short)
    assert not check(inp, bad, T)
    msg = _refused(spec, inp, bad)
    assert "out.scale" in msg and "padding" in msg, msg


def test_an_empty_input_shares_no_memory_even_at_an_outputs_address():
    """gemm2_out with no rows (P == 0) touches no byte: validate_out's _span is None for it, so
    an empty gemm2_out whose address lies inside an output is accepted by both."""
    spec = _spec("none")
    check = output_check(spec, CPU)
    arena, inp, out = _laid_out(spec, T)
    inside = out.residual_out.data_ptr() - arena.buffer.data_ptr() + 16
    empty = arena.at(torch.empty(0, 64, dtype=torch.bfloat16), inside)
    moved = inp._replace(gemm2_out=empty)
    validate_out(spec, moved, out, T, CPU)
    assert check(moved, out, T)


@pytest.mark.parametrize("quant", ["none", "nvfp4_swizzled"])
def test_a_check_for_a_cuda_device_refuses_cpu_outputs(quant):
    """The CUDA branch of the device check (device index against `get_device()`), on CPU: a
    check bound to cuda:0 refuses outputs on the CPU, as validate_out does (without quant the
    rows are the only outputs whose device is read)."""
    spec = _spec(quant)
    cuda = torch.device("cuda", 0)
    inp = make_inputs(spec, T, seed=7)
    out = allocate_outputs(spec, T, CPU)
    assert output_check(spec, CPU)(inp, out, T)
    assert not output_check(spec, cuda)(inp, out, T)
    with pytest.raises(EpilogueInputError, match=r"out\.residual_out\.device"):
        validate_out(spec, inp, out, T, cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["none", "nvfp4_swizzled", "group_column_major_tma"])
def test_one_field_off_the_gpu_is_refused(quant):
    """On a GPU: every output on cuda passes; any one field moved to the CPU (same shape, dtype
    and strides) is refused by the fast check and named by validate_out."""
    spec = _spec(quant)
    device = torch.device("cuda", torch.cuda.current_device())
    check = output_check(spec, device)
    inp = make_inputs(spec, T, seed=8, device=device)
    out = allocate_outputs(spec, T, device)
    assert check(inp, out, T)
    for field in _fields(out):
        t = getattr(out, field)
        bad = dataclasses.replace(out, **{field: torch.empty_strided(t.shape, t.stride(),
                                                                    dtype=t.dtype)})  # fmt: skip
        assert not check(inp, bad, T), field
        with pytest.raises(EpilogueInputError, match=rf"out\.{field}\.device"):
            validate_out(spec, inp, bad, T, device)
