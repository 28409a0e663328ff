"""The FlashInfer internals fusion_bridge/strategies/flashinfer_calls.py relies on (bound in
flashinfer_internals.py), pinned against
the
installed flashinfer (0.7.2.post1), and the pre-bound calls checked against the public wrappers: for
the same call, the direct path hands the compiled function exactly what the wrapper would hand it,
and raises where the wrapper raises.

Skipped only when flashinfer is not installed at all."""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("flashinfer") is None:
    pytest.skip(
        "flashinfer-python is not installed (the 'flashinfer' extra)", allow_module_level=True
    )

import flashinfer.comm as fi_comm  # noqa: E402  (a broken install fails here, loudly)
from flashinfer.comm import trtllm_ar  # noqa: E402

from fusion_bridge.strategies import flashinfer_calls as fc  # noqa: E402
from fusion_bridge.strategies import flashinfer_internals as fint  # noqa: E402

H, WORLD, MAX_TOKENS = 7168, 2, 16384
pytestmark = pytest.mark.filterwarnings("ignore:use the unified API:DeprecationWarning")


# ---- the internals themselves
# ----------------------------------------------------------------------------


def test_comm_module_namespace_is_a_cached_factory_whose_functions_close_over_module():
    factory = trtllm_ar.get_trtllm_comm_module
    assert hasattr(factory, "cache_info"), "get_trtllm_comm_module is no longer functools.cache'd"
    inner_codes = {
        c.co_name: c for c in factory.__wrapped__.__code__.co_consts if inspect.iscode(c)
    }
    for name in ("trtllm_allreduce_fusion", "trtllm_moe_finalize_allreduce_fusion"):
        assert "module" in inner_codes[name].co_freevars, f"{name} does not close over `module`"


def test_positional_order_of_the_compiled_calls_is_pinned():
    assert fc.compiled_call_order("trtllm_allreduce_fusion") == fc.ALLREDUCE_FUSION_ARGS
    assert fc.compiled_call_order("trtllm_moe_finalize_allreduce_fusion") == fc.MOE_FINALIZE_ARGS


def test_public_wrappers_are_the_verified_ones():
    for name, fingerprint in fc.VERIFIED_WRAPPERS.items():
        assert fc.wrapper_fingerprint(name) == fingerprint, (
            f"flashinfer's {name} changed: re-read it, replicate its per-call checks in "
            "flashinfer_calls.py, "
            "then update VERIFIED_WRAPPERS in flashinfer_internals.py"
        )
    assert fi_comm.trtllm_allreduce_fusion is trtllm_ar.trtllm_allreduce_fusion
    assert (
        fi_comm.trtllm_moe_finalize_allreduce_fusion
        is trtllm_ar.trtllm_moe_finalize_allreduce_fusion
    )


def test_the_helpers_the_direct_path_uses_exist():
    assert list(inspect.signature(trtllm_ar._should_use_oneshot).parameters) == [
        "token_num",
        "hidden_dim",
        "dtype",
        "world_size",
    ]
    assert trtllm_ar.MAX_COMM_SIZE == 2147483647 & ~((1 << 21) - 1)
    source = inspect.getsource(trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)
    for key in ("max_token_num", "hidden_dim", "tp_size", "use_fp32_lamport"):
        assert f'"{key}"' in source


def test_fingerprint_changes_with_a_statement_but_not_with_the_docstring(monkeypatch):
    name = "trtllm_moe_finalize_allreduce_fusion"
    _, source, _ = fint._module_source()
    node = fint._top_level_def(name)
    lines = source.splitlines()
    doc = node.body[0]

    def fingerprint_of(new_lines):
        text = "\n".join(new_lines)
        monkeypatch.setattr(
            fint, "_module_source", lambda: (trtllm_ar, text, __import__("ast").parse(text))
        )
        return fint.wrapper_fingerprint(name)

    redoc = lines[: doc.lineno - 1] + ['    """Another docstring."""'] + lines[doc.end_lineno :]
    assert fingerprint_of(redoc) == fc.VERIFIED_WRAPPERS[name]
    check = next(i for i in range(node.lineno, node.end_lineno) if "> MAX_COMM_SIZE" in lines[i])
    edited = list(lines)
    edited[check] = edited[check].replace("> MAX_COMM_SIZE", ">= MAX_COMM_SIZE")
    assert fingerprint_of(edited) != fc.VERIFIED_WRAPPERS[name]


# ---- the bound calls against the public wrappers
# ----------------------------------------------------------


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def workspace(world=WORLD, max_tokens=MAX_TOKENS, fp32=False):
    return SimpleNamespace(
        workspace_tensor=torch.zeros(3, dtype=torch.int64),
        metadata={
            "tp_size": world,
            "max_token_num": max_tokens,
            "hidden_dim": H,
            "use_fp32_lamport": fp32,
        },
    )


def bound_allreduce(monkeypatch, direct=True, **kw):
    compiled = Recorder()
    monkeypatch.setattr(
        fc, "compiled_function", lambda name, order: (compiled, None) if direct else (None, "x")
    )
    args = dict(
        world_size=WORLD,
        rank=1,
        hidden=H,
        dtype=torch.bfloat16,
        pattern=fi_comm.AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant,
        scale_factor=torch.tensor([0.5]),
        layout=None,
        eps=1e-6,
        weight_bias=1.0,
    )
    args.update(kw)
    return fc.AllReduceFusionCall(fi_comm, workspace(), **args), compiled


def tensors(tokens):
    return [torch.zeros(tokens, 8, dtype=torch.bfloat16) for _ in range(6)] + [
        torch.zeros(8, dtype=torch.bfloat16)
    ]


def what_the_wrapper_passes(monkeypatch, call, tokens, use_oneshot, ts):
    """Run flashinfer's public wrapper with the compiled-module namespace replaced by a recorder."""
    inner = Recorder()
    monkeypatch.setattr(
        trtllm_ar, "get_trtllm_comm_module", lambda: SimpleNamespace(trtllm_allreduce_fusion=inner)
    )
    allreduce_in, residual_in, residual_out, norm_out, quant_out, scale_out, gamma = ts
    fi_comm.trtllm_allreduce_fusion(
        allreduce_in=allreduce_in,
        world_size=call.world_size,
        world_rank=call.rank,
        token_num=tokens,
        hidden_dim=call.hidden,
        workspace_ptrs=call.workspace_ptrs,
        launch_with_pdl=call.pdl,
        trigger_completion_at_end=call.trigger,
        fp32_acc=call.fp32_acc,
        pattern_code=call.pattern,
        use_oneshot=use_oneshot,
        allreduce_out=None,
        residual_in=residual_in,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale_out=scale_out,
        rms_gamma=gamma,
        rms_eps=call.eps,
        scale_factor=call.scale_factor,
        layout_code=call.layout,
        weight_bias=call.weight_bias,
    )
    ((args, kwargs),) = inner.calls
    assert not args
    return kwargs


def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and torch.equal(a, b)
            and a.dtype == b.dtype
        )
    return a == b and type(a) is type(b)


@pytest.mark.parametrize(
    "tokens,use_oneshot",
    [(1, True), (3, False), (64, True), (64, False), (10000, False), (MAX_TOKENS, True)],
)
@pytest.mark.parametrize("flags", [(False, True, True), (True, False, True), (False, True, False)])
def test_direct_allreduce_passes_what_the_wrapper_passes(monkeypatch, tokens, use_oneshot, flags):
    pdl, trigger, fp32_acc = flags
    call, compiled = bound_allreduce(
        monkeypatch, launch_with_pdl=pdl, trigger_completion_at_end=trigger, fp32_acc=fp32_acc
    )
    ts = tensors(tokens)
    allreduce_in, residual_in, residual_out, norm_out, quant_out, scale_out, gamma = ts
    call(
        allreduce_in,
        tokens,
        use_oneshot,
        residual_in,
        residual_out,
        norm_out,
        quant_out,
        scale_out,
        gamma,
    )
    ((args, kwargs),) = compiled.calls
    assert not kwargs and len(args) == len(fc.ALLREDUCE_FUSION_ARGS)
    expected = what_the_wrapper_passes(monkeypatch, call, tokens, use_oneshot, ts)
    got = dict(zip(fc.ALLREDUCE_FUSION_ARGS, args))
    assert set(got) == set(expected)
    for name in got:
        assert same(got[name], expected[name]), (
            f"{name}: direct {got[name]!r}, wrapper {expected[name]!r}"
        )


def test_direct_allreduce_keeps_the_two_shot_token_check(monkeypatch):
    call, compiled = bound_allreduce(monkeypatch)
    ts = tensors(WORLD)
    with pytest.raises(ValueError, match="two-shot needs token_num > world_size"):
        call(ts[0], WORLD, False, *ts[1:])
    with pytest.raises(AssertionError):  # the wrapper refuses the same call
        what_the_wrapper_passes(monkeypatch, call, WORLD, False, ts)
    assert compiled.calls == []


@pytest.mark.parametrize("direct", [True, False])
def test_allreduce_call_never_overrides_the_planned_variant(monkeypatch, direct):
    """The planner alone chooses one-shot or two-shot: one-shot above the Lamport buffers raises
    (FlashInfer's wrapper would switch to two-shot), and so do two-shot at T <= world size and a
    use_oneshot of None (the wrapper's own heuristic), on both paths."""
    call, compiled = bound_allreduce(monkeypatch, direct=direct)
    call.max_tokens = None  # a workspace large enough; the Lamport limit decides
    tokens = call.oneshot_max_tokens + 1
    ts = tensors(1)
    with pytest.raises(ValueError, match="one-shot holds at most"):
        call(ts[0], tokens, True, *ts[1:])
    # the wrapper, given the same request, switches: that is the override the call refuses
    assert what_the_wrapper_passes(monkeypatch, call, tokens, True, ts)["use_oneshot"] is False
    with pytest.raises(ValueError, match="two-shot needs token_num > world_size"):
        call(ts[0], WORLD, False, *ts[1:])
    with pytest.raises(TypeError, match="use_oneshot must be True or False"):
        call(ts[0], 64, None, *ts[1:])
    assert compiled.calls == []
    if direct:
        call(ts[0], tokens - 1, True, *ts[1:])
        assert dict(zip(fc.ALLREDUCE_FUSION_ARGS, compiled.calls[0][0]))["use_oneshot"] is True


def test_direct_allreduce_refuses_more_tokens_than_the_workspace(monkeypatch):
    call, compiled = bound_allreduce(monkeypatch)
    ts = tensors(1)
    with pytest.raises(ValueError, match="exceeds the workspace"):
        call(ts[0], MAX_TOKENS + 1, True, *ts[1:])
    assert compiled.calls == []


def test_bind_time_checks(monkeypatch):
    with pytest.raises(TypeError, match="scale_factor must be a tensor"):
        bound_allreduce(monkeypatch, scale_factor=0.5)
    with pytest.raises(ValueError, match="tp_size"):
        bound_allreduce(monkeypatch, world_size=4)
    with pytest.raises(ValueError, match="use_fp32_lamport"):
        bound_allreduce(monkeypatch, dtype=torch.float32)
    call, _ = bound_allreduce(monkeypatch, scale_factor=torch.tensor([2.0], dtype=torch.float64))
    assert call.scale_factor.dtype == torch.float32


def test_without_the_internals_the_public_wrapper_is_called(monkeypatch):
    call, compiled = bound_allreduce(monkeypatch, direct=False)
    assert call.direct is None and "public wrapper" in fc.describe(call)
    public = Recorder()
    monkeypatch.setattr(call, "_fi", SimpleNamespace(trtllm_allreduce_fusion=public))
    ts = tensors(4)
    call(ts[0], 4, True, *ts[1:])
    ((args, kwargs),) = public.calls
    assert not args and set(kwargs) <= set(
        inspect.signature(fi_comm.trtllm_allreduce_fusion).parameters
    )
    assert kwargs["token_num"] == 4 and kwargs["workspace_ptrs"] is call.workspace_ptrs


def test_on_this_machine_feature_detection_answers_without_raising():
    """Here (no CUDA build of the comm module) the lookup fails and says why; on the GPU it
    succeeds."""
    fn, reason = fc.compiled_function("trtllm_allreduce_fusion", fc.ALLREDUCE_FUSION_ARGS)
    assert (fn is None) == (reason is not None)
    if not torch.cuda.is_available():
        assert fn is None


def test_a_changed_wrapper_is_not_called_directly(monkeypatch):
    monkeypatch.setitem(fc.VERIFIED_WRAPPERS, "trtllm_allreduce_fusion", "0" * 16)
    fn, reason = fc.compiled_function("trtllm_allreduce_fusion", fc.ALLREDUCE_FUSION_ARGS)
    assert fn is None and "not the verified one" in reason
    fn, reason = fc.compiled_function(
        "trtllm_moe_finalize_allreduce_fusion", fc.ALLREDUCE_FUSION_ARGS
    )
    assert fn is None and ("expected" in reason or "RuntimeError" in reason)


def bound_moe(monkeypatch, direct=True):
    compiled = Recorder()
    monkeypatch.setattr(
        fc, "compiled_function", lambda name, order: (compiled, None) if direct else (None, "x")
    )
    return fc.MoeFinalizeCall(
        fi_comm,
        workspace(),
        world_size=WORLD,
        rank=0,
        eps=1e-5,
        routed_scaling_factor=2.5,
        weight_bias=0.0,
    ), compiled


def moe_tensors(tokens, hidden=8):
    t = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    return (
        t(tokens * 8, hidden),
        t(tokens, hidden),
        t(hidden),
        torch.zeros(tokens, 8, dtype=torch.int32),
        t(tokens, hidden),
        t(tokens, hidden),
        None,
        None,
        t(tokens, hidden),
        t(tokens, 8),
    )


@pytest.mark.parametrize("tokens", [1, 64])
def test_direct_moe_finalize_passes_what_the_wrapper_passes(monkeypatch, tokens):
    call, compiled = bound_moe(monkeypatch)
    ts = moe_tensors(tokens)
    call(*ts)
    ((args, kwargs),) = compiled.calls
    assert not kwargs
    got = dict(zip(fc.MOE_FINALIZE_ARGS, args))
    inner = Recorder()
    monkeypatch.setattr(
        trtllm_ar,
        "get_trtllm_comm_module",
        lambda: SimpleNamespace(trtllm_moe_finalize_allreduce_fusion=inner),
    )
    (
        allreduce_in,
        residual_in,
        norm_weight,
        idx,
        norm_out,
        residual_out,
        quant_out,
        scale_out,
        shared,
        weights,
    ) = ts
    fi_comm.trtllm_moe_finalize_allreduce_fusion(
        allreduce_in=allreduce_in,
        residual_in=residual_in,
        norm_weight=norm_weight,
        expanded_idx_to_permuted_idx=idx,
        norm_out=norm_out,
        residual_out=residual_out,
        quant_out=quant_out,
        scale_out=scale_out,
        workspace_ptrs=call.workspace_ptrs,
        launch_with_pdl=False,
        world_rank=0,
        world_size=WORLD,
        eps=1e-5,
        shared_expert_output=shared,
        expert_scale_factor=weights,
        routed_scaling_factor=2.5,
        weight_bias=0.0,
    )
    ((_, expected),) = inner.calls
    assert set(got) == set(expected)
    for name in got:
        assert same(got[name], expected[name]), (
            f"{name}: direct {got[name]!r}, wrapper {expected[name]!r}"
        )


def test_direct_moe_finalize_keeps_the_lamport_size_check(monkeypatch):
    call, compiled = bound_moe(monkeypatch)
    tokens = trtllm_ar.MAX_COMM_SIZE // (2 * WORLD) + 1  # hidden 1: one element per token
    ts = list(moe_tensors(1, hidden=1))
    ts[1] = torch.empty(tokens, 1, dtype=torch.bfloat16, device="meta")  # sized, never allocated
    with pytest.raises(ValueError, match="required_lamport_comm_size"):
        call(*ts)
    assert compiled.calls == []
