"""The engines' real class definitions, from their wheels, without installing an engine.

Installing vLLM would replace the CPU torch with its CUDA build, and SGLang's classes import its
whole runtime. So:

- vLLM 0.34.0: `vllm/model_executor/layers/fused_moe/moe_output.py` imports only `dataclasses`
  and `torch`; it is read from the wheel and loaded on its own (importlib), so `MoEOutput`,
  `UnfinalizedMoEOutput` and `route_major_moe_output` are vLLM's own code.
- SGLang 0.5.23: `MoeDeferredFinalize` (a frozen msgspec.Struct), FlashInfer's deferred buffers
  (`FlashInferTrtllmDeferredFinalizeOutput`) and `MoEOutput` (a NamedTuple) are read with `ast`:
  their annotated fields, in order, become a frozen dataclass / NamedTuple of the same module and
  name.
- The norm classes (vLLM's and SGLang's `RMSNorm`, `GemmaRMSNorm`): their sources are read with
  `ast` (the attributes `__init__` sets, what the forward multiplies by), and a stand-in module of
  the same module and qualified name holds the same attributes (`engine_norm`).

The wheels are looked for in $ENGINE_WHEELS_DIR, /tmp/wheels51 and
~/.cache/fusion_bridge/test-wheels, and otherwise downloaded there with `pip download --no-deps`
(the download is skipped when ENGINE_WHEELS_NO_DOWNLOAD=1). Where a wheel cannot be had, the
tests that need it skip with one reason.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

VLLM = ("vllm", "0.34.0")
SGLANG = ("sglang", "0.5.23")
MOE_OUTPUT = "vllm/model_executor/layers/fused_moe/moe_output.py"
VLLM_NORMS = "vllm/model_executor/layers/layernorm.py"
SGL_DEFERRED = "sglang/srt/layers/layer_boundary/fusions/moe_finalize.py"
SGL_FLASHINFER = "sglang/srt/layers/moe/moe_runner/flashinfer_trtllm.py"
SGL_MOE_OUTPUT = "sglang/srt/models/deepseek_v2.py"
SGL_NORMS = "sglang/srt/layers/layernorm.py"
SGL_FUSED_GAMMA = "sglang/srt/layers/layer_boundary/fusions/norm.py"


def _dirs() -> list[Path]:
    dirs = [os.environ.get("ENGINE_WHEELS_DIR"), "/tmp/wheels51"]
    dirs.append(str(Path.home() / ".cache" / "fusion_bridge" / "test-wheels"))
    return [Path(d) for d in dirs if d]


@functools.lru_cache(maxsize=None)
def wheel(name: str, version: str) -> Optional[Path]:
    """The wheel's path, downloaded into the last directory if no directory has it; None when it
    cannot be had."""
    for d in _dirs():
        found = sorted(d.glob(f"{name}-{version}-*.whl"))
        if found:
            return found[0]
    if os.environ.get("ENGINE_WHEELS_NO_DOWNLOAD") == "1":
        return None
    cache = _dirs()[-1]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += [f"{name}=={version}", "-d", str(cache)]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError):
        return None
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    return found[0] if found else None


def source(engine: tuple, member: str) -> str:
    """A file's text from the engine's wheel; skips the test when the wheel cannot be had."""
    path = wheel(*engine)
    if path is None:
        pytest.skip(f"the {engine[0]}=={engine[1]} wheel could not be found or downloaded")
    with zipfile.ZipFile(path) as z:
        return z.read(member).decode("utf-8")


@functools.lru_cache(maxsize=None)
def _vllm_module():
    text = source(VLLM, MOE_OUTPUT)
    with tempfile.TemporaryDirectory(prefix="fb_vllm_moe_output_") as folder:
        path = Path(folder) / "moe_output.py"
        path.write_text(text)
        name = "_fusion_bridge_test_vllm_moe_output"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses looks its module up there
        spec.loader.exec_module(module)
    return module


def vllm_moe_output():
    """vLLM's own moe_output module (MoEOutput, UnfinalizedMoEOutput, route_major_moe_output)."""
    return _vllm_module()


def class_def(text: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not in the source")


def fields_of(text: str, name: str) -> list[str]:
    """The annotated fields of a class body, in order (a msgspec.Struct's, a dataclass's, a
    NamedTuple's fields)."""
    return [
        n.target.id
        for n in class_def(text, name).body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def _module_of(member: str) -> str:
    return member[: -len(".py")].replace("/", ".")


@functools.lru_cache(maxsize=None)
def sglang_classes() -> dict:
    """SGLang's MoeDeferredFinalize (frozen), FlashInfer's deferred buffers and MoEOutput (a
    NamedTuple), each with the fields and order its source declares, under its own module."""
    out = {}
    for member, name in (
        (SGL_DEFERRED, "MoeDeferredFinalize"),
        (SGL_FLASHINFER, "FlashInferTrtllmDeferredFinalizeOutput"),
    ):
        fields = fields_of(source(SGLANG, member), name)
        cls = dataclasses.make_dataclass(name, fields, frozen=True)
        cls.__module__ = _module_of(member)
        out[name] = cls
    fields = fields_of(source(SGLANG, SGL_MOE_OUTPUT), "MoEOutput")
    moe_output = NamedTuple("MoEOutput", [(f, object) for f in fields])
    moe_output.__module__ = _module_of(SGL_MOE_OUTPUT)
    out["MoEOutput"] = moe_output
    return out


def sglang_from_flashinfer(deferred, *, gated_shared_output, m: int):
    """`MoeDeferredFinalize.from_flashinfer`'s views, as its source writes them (checked against
    the source in the tests): gemm2_out.view(-1, H), the index and weight buffers
    .view(-1, top_k)[:m]."""
    cls = sglang_classes()["MoeDeferredFinalize"]
    top_k = int(deferred.top_k)
    return cls(
        routed_output=deferred.gemm2_out.view(-1, deferred.gemm2_out.shape[-1]),
        expert_weights=deferred.expert_weights.view(-1, top_k)[:m],
        permuted_indices=deferred.expanded_idx_to_permuted_idx.view(-1, top_k)[:m],
        gated_shared_output=gated_shared_output,
        m=int(m),
        finish=lambda: None,
    )


def engine_norm(engine: tuple, class_name: str, weight: torch.Tensor, eps: float):
    """A stand-in of the engine's norm class: the same module and qualified name, the attributes
    its __init__ sets (weight, variance_epsilon; SGLang's GemmaRMSNorm also gemma_weight = weight
    + 1, as its refresh_gemma_weight computes)."""
    member = VLLM_NORMS if engine is VLLM else SGL_NORMS
    init = next(
        n for n in class_def(source(engine, member), class_name).body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )  # fmt: skip
    assigned = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    }
    assert {"weight", "variance_epsilon"} <= assigned, (engine, class_name, assigned)

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            self.variance_epsilon = eps
            if engine is SGLANG and class_name == "GemmaRMSNorm":
                self.register_buffer("gemma_weight", self.weight.detach() + 1, persistent=False)

    Norm.__module__, Norm.__name__, Norm.__qualname__ = _module_of(member), class_name, class_name
    return Norm()
