"""The FlashInfer internals behind the pre-bound comm calls (flashinfer_calls.py), and the checks
that decide, once per bind, whether the compiled function may be called directly.

Internals used (flashinfer 0.7.2.post1; pinned by tests/strategies/test_flashinfer_internals.py):
`flashinfer.comm.trtllm_ar.get_trtllm_comm_module()` (functools.cache'd namespace of Python
functions), the closure variable `module` of its `trtllm_allreduce_fusion` /
`trtllm_moe_finalize_allreduce_fusion` (the loaded TVM-FFI module), and the positional order in
which those functions call `module.<name>(...)`. The direct call is used only when, at bind time
(the strategy's prepare), all of this is found and both the positional order and the public
wrapper's code (its AST without docstring and decorators) are the ones verified here; otherwise the
bound call uses the public wrapper, and `.reason` says why.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
from typing import Callable, Optional

# The order in which get_trtllm_comm_module()'s functions pass their arguments to the compiled
# module (flashinfer 0.7.2.post1, flashinfer/comm/trtllm_ar.py).
ALLREDUCE_FUSION_ARGS = (
    "allreduce_in",
    "world_size",
    "world_rank",
    "token_num",
    "hidden_dim",
    "workspace_ptrs",
    "launch_with_pdl",
    "use_oneshot",
    "trigger_completion_at_end",
    "fp32_acc",
    "pattern_code",
    "allreduce_out",
    "residual_in",
    "residual_out",
    "norm_out",
    "quant_out",
    "scale_out",
    "rms_gamma",
    "rms_eps",
    "scale_factor",
    "layout_code",
    "block_quant_group_size",
    "weight_bias",
)
MOE_FINALIZE_ARGS = (
    "allreduce_in",
    "residual_in",
    "norm_weight",
    "expanded_idx_to_permuted_idx",
    "norm_out",
    "residual_out",
    "quant_out",
    "scale_out",
    "launch_with_pdl",
    "workspace",
    "world_rank",
    "world_size",
    "eps",
    "shared_expert_output",
    "expert_scale_factor",
    "routed_scaling_factor",
    "weight_bias",
)
# Fingerprints (see wrapper_fingerprint) of the public wrappers whose checks are replicated below.
VERIFIED_WRAPPERS = {
    "trtllm_allreduce_fusion": "cf9b26bc08b5c549",
    "trtllm_moe_finalize_allreduce_fusion": "c464a0899bf15c4d",
}


@functools.lru_cache(maxsize=1)
def _module_source():
    from flashinfer.comm import trtllm_ar

    source = inspect.getsource(trtllm_ar)
    return trtllm_ar, source, ast.parse(source)


def _top_level_def(name: str) -> Optional[ast.FunctionDef]:
    for node in _module_source()[2].body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def wrapper_fingerprint(name: str) -> Optional[str]:
    """A hash of the public wrapper's code lines: from `def` to its end, without decorators, the
    docstring, comments, blank lines and trailing spaces. Any change of a statement changes it (and
    so does a reformatting: re-verify then); a change of documentation does not."""
    node = _top_level_def(name)
    if node is None:
        return None
    lines = _module_source()[1].splitlines()
    skip: set[int] = set()
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        skip = set(range(first.lineno, first.end_lineno + 1))
    kept = [lines[i - 1].rstrip() for i in range(node.lineno, node.end_lineno + 1) if i not in skip]
    kept = [line for line in kept if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def compiled_call_order(name: str) -> Optional[tuple[str, ...]]:
    """The positional argument names with which get_trtllm_comm_module()'s `name` calls
    `module.name(...)`, read from the source; None when that call is not found."""
    outer = _top_level_def("get_trtllm_comm_module")
    if outer is None:
        return None
    for node in ast.walk(outer):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == name
                    and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "module"
                ):
                    if call.keywords or not all(isinstance(a, ast.Name) for a in call.args):
                        return None
                    return tuple(a.id for a in call.args)
    return None


def compiled_function(
    name: str, expected_order: tuple[str, ...]
) -> tuple[Optional[Callable], Optional[str]]:
    """(the compiled module's `name`, None) or (None, why not). Loads the module as the
    wrapper would."""
    try:
        fingerprint = wrapper_fingerprint(name)
        if fingerprint != VERIFIED_WRAPPERS[name]:
            return None, (
                f"flashinfer's {name} wrapper is not the verified one (fingerprint {fingerprint}, "
                f"verified {VERIFIED_WRAPPERS[name]} = 0.7.2.post1): its checks may differ"
            )
        order = compiled_call_order(name)
        if order != expected_order:
            return (
                None,
                f"get_trtllm_comm_module().{name} passes {order}, expected {expected_order}",
            )
        trtllm_ar = _module_source()[0]
        inner = getattr(trtllm_ar.get_trtllm_comm_module(), name)
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
        module = cells["module"].cell_contents
        fn = getattr(module, name)
        if not callable(fn):
            return None, f"the compiled module's {name} is not callable"
        return fn, None
    except Exception as exc:  # any missing internal: the public wrapper
        return None, f"{name}: {type(exc).__name__}: {exc}"
