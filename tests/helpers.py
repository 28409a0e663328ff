"""Test-only helpers."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs

_Result = TypeVar("_Result")


def garbage_weights_where_skipped(inputs: EpilogueInputs) -> EpilogueInputs:
    """The same call with NaN weights in the skipped slots (perm == -1), +inf in every third one:
    the spec allows garbage there, so a kernel that multiplies a skipped slot's weight in (x * w
    with x = 0 is NaN) shows NaN. The caller's tensors are left alone."""
    perm, weights = inputs.expanded_idx_to_permuted_idx, inputs.expert_weights.clone()
    skipped = perm < 0
    weights[skipped] = float("nan")
    every_third = torch.zeros_like(skipped).view(-1)
    every_third[::3] = True
    weights[skipped & every_third.view(skipped.shape)] = float("inf")
    return inputs._replace(expert_weights=weights)


def small_rows_and_a_zero_row(spec, world: int, tokens: int, seed: int, device="cpu") -> list:
    """Per-rank inputs for `world` ranks (one residual and gamma, as in a TP group) whose rows have
    an rms of ~0.01-0.03 (then eps = 1e-2 shrinks norm_out about 3x) and whose row 1 is exactly
    zero on every rank: residual 0, every slot skipped, shared output 0. There x = 0, so norm_out
    is 0 with eps > 0 and NaN (0 * rsqrt(0)) without it. NaN / inf weights in skipped slots."""
    from fusion_bridge.oracle.synthetic import make_inputs

    out = []
    for r in range(world):
        inp = make_inputs(spec, tokens, rank=r, seed=seed, device=device, skip_fraction=0.3)
        perm = inp.expanded_idx_to_permuted_idx.clone()
        perm[1] = -1
        shared = inp.shared_output
        if shared is not None:
            shared = shared * 0.01
            shared[1] = 0.0
        out.append(
            garbage_weights_where_skipped(
                inp._replace(
                    gemm2_out=inp.gemm2_out * 0.01,
                    expanded_idx_to_permuted_idx=perm,
                    shared_output=shared,
                )
            )
        )
    residual = out[0].residual * 0.01
    residual[1] = 0.0
    return [inp._replace(residual=residual, gamma=out[0].gamma) for inp in out]


def clone_inputs(inputs: EpilogueInputs) -> EpilogueInputs:
    return EpilogueInputs(
        *(
            None if t is None else t.clone()
            for t in (
                inputs.gemm2_out,
                inputs.expanded_idx_to_permuted_idx,
                inputs.expert_weights,
                inputs.shared_output,
                inputs.residual,
                inputs.gamma,
            )
        )
    )


def inputs_equal(a: EpilogueInputs, b: EpilogueInputs) -> bool:
    pairs = [
        (a.gemm2_out, b.gemm2_out),
        (a.expanded_idx_to_permuted_idx, b.expanded_idx_to_permuted_idx),
        (a.expert_weights, b.expert_weights),
        (a.shared_output, b.shared_output),
        (a.residual, b.residual),
        (a.gamma, b.gamma),
    ]
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and x.shape == y.shape
            and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
        )
        for x, y in pairs
    )


def cpu_strategy_names(world_size: int = 1) -> list[str]:
    """The registered strategies that run in this CPU test setup (our Triton kernels under the
    interpreter included: conftest sets TRITON_INTERPRET=1), found by building a bridge, so a
    renamed strategy is still covered; with world_size > 1, those whose capability checks also pass
    at that world size (a world-size-1 path drops out). Fails unless the three kinds the suite
    relies on are all there: the oracle, the torch path and a path through our kernels."""
    from fusion_bridge import EpilogueSpec, FusionBridge
    from fusion_bridge.registry import strategy_class

    spec = EpilogueSpec(hidden_size=64, top_k=2)
    with FusionBridge(spec) as bridge:
        names = [s.name for s in bridge.statuses if s.available]
        env = bridge.env.replace(world_size=world_size)
    names = [n for n in names if not strategy_class(n).not_supported_reasons(spec, env)]
    assert (
        "reference" in names
        and "separate" in names
        and any(n.startswith("local_fused") for n in names)
    ), names
    return names


def scaled_inputs(inputs: EpilogueInputs, factor: float) -> EpilogueInputs:
    """gemm2_out, shared_output and residual times `factor` (rounded to their dtype): small rows,
    where
    eps is observable. Routing, weights and gamma unchanged."""

    def scale(t):
        return None if t is None else (t.float() * factor).to(t.dtype)

    return inputs._replace(
        gemm2_out=scale(inputs.gemm2_out),
        shared_output=scale(inputs.shared_output),
        residual=scale(inputs.residual),
    )


def quant_problems(quant, norm_out, q, sf, nan_rows=()) -> list:
    """Why the quantized outputs q (uint8 view) and sf are not quant_ref's of `norm_out` bit for
    bit, scale padding included (empty: they are); quant_ref runs on norm_out's device, whose
    arithmetic decides a NaN's sign (a GPU's NaN is positive). nan_rows: rows whose norm_out must
    be all NaN and stay NaN once quantized: every fp8 code e4m3's NaN (0x7F, with the sign bit),
    every NVFP4 block scale of the row e4m3's NaN 0x7F (its codes then carry only signs)."""
    from fusion_bridge.oracle.quant_ref import quantize_fp8, quantize_nvfp4, swizzled_sf_offset
    from fusion_bridge.spec import QuantKind, SFLayout

    problems = []
    on_device, norm_out, q = norm_out, norm_out.cpu(), q.cpu().view(torch.uint8)
    rows = list(nan_rows)
    if rows and not torch.isnan(norm_out[rows].float()).all():
        problems.append(f"norm_out rows {rows} are not all NaN")
    if quant.kind is QuantKind.FP8:
        ref = quantize_fp8(on_device, quant.scale).view(torch.uint8).cpu()
        # e4m3's NaN is 0x7F with either sign; which sign a NaN gets is not ours to fix: the GPU's
        # conversion keeps the input's (a -NaN input gives 0xFF) where torch's GPU arithmetic in
        # quant_ref makes it positive. Every other code is compared bit for bit.
        nan_both = ((q & 0x7F) == 0x7F) & ((ref & 0x7F) == 0x7F)
        if not ((q == ref) | nan_both).all():
            bad = ((q != ref) & ~nan_both).nonzero()[:4].tolist()
            problems.append(f"fp8 codes differ from quant_ref at {bad}")
        if rows and not ((q[rows] & 0x7F) == 0x7F).all():
            problems.append(f"fp8 codes of NaN rows {rows} are not NaN: {q[rows][:, :8].tolist()}")
    elif quant.kind is QuantKind.NVFP4:
        sf = sf.cpu()
        ref_q, ref_sf = quantize_nvfp4(on_device, quant.global_scale, quant.sf_layout)
        ref_q, ref_sf = ref_q.cpu(), ref_sf.cpu()
        if not torch.equal(q, ref_q):
            problems.append(
                f"nvfp4 codes differ from quant_ref at {(q != ref_q).nonzero()[:4].tolist()}"
            )
        if not torch.equal(sf, ref_sf):
            problems.append(
                f"nvfp4 scales differ from quant_ref at {(sf != ref_sf).nonzero()[:4].tolist()}"
            )
        blocks = norm_out.shape[1] // 16
        for row in rows:
            if quant.sf_layout is SFLayout.LINEAR:
                scales = sf[row]
            else:
                k = torch.arange(blocks)
                scales = sf.reshape(-1)[swizzled_sf_offset(torch.full_like(k, row), k, blocks)]
            if not (scales == 0x7F).all():
                problems.append(
                    f"nvfp4 block scales of NaN row {row} are not NaN: {scales.tolist()}"
                )
    elif quant.dynamic_fp8:
        problems += _dynamic_fp8_problems(quant, on_device, q, sf, rows)
    return problems


def _dynamic_fp8_problems(quant, norm_out, q, sf, rows) -> list:
    """quant_problems for the dynamic FP8 kinds: codes (every NaN code 0x7F: our rule, whatever
    the device's NaN sign) and scale bits against quant_ref on norm_out's device, the scale view's
    strides and its storage's TMA padding zeros; NaN rows: every scale NaN, every code 0x7F."""
    from fusion_bridge.oracle.quant_ref import fp8_scale_view, quantize_fp8_per_token_group

    group = quant.group_size or norm_out.shape[1]
    ref_q, ref_s = quantize_fp8_per_token_group(norm_out, group)
    ref_q, ref_s = ref_q.view(torch.uint8).cpu(), ref_s.cpu()
    problems = []
    if not torch.equal(q, ref_q):
        problems.append(f"fp8 codes differ from quant_ref at {(q != ref_q).nonzero()[:4].tolist()}")
    want = fp8_scale_view(ref_s, quant.scale_layout or "row_major")
    if sf.shape != want.shape or (sf.shape[0] > 1 and sf.stride() != want.stride()):
        problems.append(f"scale view {tuple(sf.shape)} {sf.stride()}, not {want.stride()}")
        return problems
    if sf.numel():
        width = want.stride(1) if want.stride(1) != 1 else None
        got_all = sf if width is None else torch.as_strided(sf, (sf.shape[1], width), (width, 1))
        ref_all = (
            want if width is None else torch.as_strided(want, (sf.shape[1], width), (width, 1))
        )
        if not torch.equal(got_all.cpu().contiguous().view(torch.int32), ref_all.view(torch.int32)):
            problems.append(f"fp32 scales (storage, padding included) differ: {sf.tolist()}")
    for row in rows:
        if not (torch.isnan(sf[row]).all() and (q[row] == 0x7F).all()):
            problems.append(f"NaN row {row}: scales {sf[row].tolist()}, codes not all 0x7F")
    return problems


class CliRun(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, env_vars: dict | None = None) -> CliRun:
    """`python -m fusion_bridge ARGS` run in this process (`fusion_bridge.cli.main.main(argv)`, the
    function `python -m fusion_bridge` calls): its exit status and what it wrote to stdout and
    stderr, as a process of its own would have them. File descriptors 1 and 2 go to files for the
    call, with sys.stdout and sys.stderr written through them, so `--json` (which points fd 1 at
    stderr and keeps a copy for the document) and C libraries' prints land where they would. As in
    a process with Python's defaults, log records of WARNING and above reach stderr (pytest's
    handlers are set aside) and so does every warning raised (pytest would record them instead).
    The environment: FUSION_BRIDGE_STRATEGY unset, then `env_vars` (name -> value; None unsets);
    os.environ is restored afterwards, whatever the command set.

    Saves the ~2-5 s of CPU a subprocess pays to import torch, triton and flashinfer again. What
    only a process of its own shows (nothing imported at --help, a reader that leaves, parity's
    ranks, the module entry point itself) is tested with one (tests/cli/test_cli.py)."""
    from fusion_bridge.cli import common
    from fusion_bridge.cli.main import main

    saved_env = dict(os.environ)
    os.environ.pop("FUSION_BRIDGE_STRATEGY", None)
    for name, value in (env_vars or {}).items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds, saved_sys = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
    saved_handlers, json_fds = logging.root.handlers[:], len(common._JSON_FD)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        logging.root.handlers = []  # no handler anywhere: logging's last resort, on sys.stderr
        try:
            with warnings.catch_warnings(record=True) as raised:
                try:
                    code = main(list(args))
                except SystemExit as exc:  # argparse: errors (2), --help and --version (0)
                    code = exc.code
            for w in raised:
                text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                sys.stderr.write(text)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved_sys
            logging.root.handlers = saved_handlers
            for target, fd in zip((1, 2), saved_fds):
                os.dup2(fd, target)
                os.close(fd)
            for fd in common._JSON_FD[json_fds:]:  # --json's copies of fd 1, as process exit would
                os.close(fd)
            del common._JSON_FD[json_fds:]
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        return CliRun(0 if code is None else code, out.read().decode(), err.read().decode())


class InterpreterPatchOncePerLaunch:
    """The Triton interpreter, minus work it repeats for nothing: it swaps `triton.language`'s
    builtins for interpreted ones when a kernel launch starts (`_patch_lang`, undone when the launch
    ends) and again at every call of a @triton.jit helper inside the launch, each time scanning the
    language modules with inspect.getmembers: about a third of an interpreted kernel's CPU time
    here (one W=4 case of test_symm_twoshot_interleavings.py: 7.3 -> 4.7 s). A helper call whose
    module sees only language modules the running launch already patched finds every builtin
    swapped already (the scan swaps only builtins; its other assignments put back equal
    replacements), so the repeat changes nothing and is skipped; any other call is patched as
    Triton does. Nothing else of the interpreter changes: the kernels run the same operations.

    Installed (tests/conftest.py, under TRITON_INTERPRET=1) only for a `_patch_lang` whose source
    is the one this was written against (Triton 3.6.0 and 3.9.0 ship it unchanged) and whose two
    callers (the launch, which undoes its patch at the end, and the helper call) are as read
    there; otherwise the interpreter is left as it is. `enabled = False` turns it off (a test
    compares)."""

    PATCH_LANG_SHA256 = "e5beeba74ada48294c1d0dbee3e55a5ac185992e2197b7ee706f3f061d880989"

    def __init__(self):
        self.enabled, self.installed = True, False
        self.patched: set[int] = set()  # ids of the language modules the running launch patched
        self.skipped = 0
        try:
            import triton.language as tl
            from triton.runtime import interpreter
        except ImportError:
            return
        try:
            as_read = (
                hashlib.sha256(inspect.getsource(interpreter._patch_lang).encode()).hexdigest()
                == self.PATCH_LANG_SHA256
                and "patch_scope = _patch_lang(self.fn)"
                in inspect.getsource(interpreter.GridExecutor.__call__)
                and "patch_scope.restore()" in inspect.getsource(interpreter.GridExecutor.__call__)
                and "_patch_lang(self.fn)"
                in inspect.getsource(interpreter.InterpretedFunction.__call__)
            )
        except (AttributeError, OSError, TypeError):
            as_read = False
        if not as_read:
            return
        self.tl, self.interpreter, self.original = tl, interpreter, interpreter._patch_lang
        self.launch_code = interpreter.GridExecutor.__call__.__code__
        interpreter._patch_lang = self.patch_lang
        self.installed = True

    def patch_lang(self, fn):
        langs = {
            id(v) for v in fn.__globals__.values() if v is self.tl or v is self.tl.core
        }  # what Triton's _patch_lang patches for fn (it asserts there is one)
        if sys._getframe(1).f_code is self.launch_code:  # a launch: patched until it ends
            scope = self.original(fn)
            restore = scope.restore

            def restore_and_forget():
                self.patched.clear()
                restore()

            scope.restore, self.patched = restore_and_forget, langs
            return scope
        if self.enabled and self.patched and langs and langs <= self.patched:
            self.skipped += 1
            return self.interpreter._LangPatchScope()  # a helper's repeat: nothing to add
        scope = self.original(fn)  # a helper seeing another language module: as Triton does
        if self.patched:
            self.patched |= langs
        return scope


_INTERPRETER: list = []


def patch_the_interpreter_once_per_launch() -> InterpreterPatchOncePerLaunch:
    """Install InterpreterPatchOncePerLaunch in this process (once; tests/conftest.py does, under
    TRITON_INTERPRET=1, before any kernel runs) and return it."""
    if not _INTERPRETER:
        _INTERPRETER.append(InterpreterPatchOncePerLaunch())
    return _INTERPRETER[0]


def once_per_run(tmp_path_factory, name: str, compute: Callable[[Path], _Result]) -> _Result:
    """compute(directory) once per pytest run, for a module fixture whose work is slow (a spawned
    group, torchrun, a child compiling kernels): under pytest-xdist a module's tests are spread over
    the workers, and each worker that gets one would set the module fixture up again (the same
    processes, the same result, twice on `-n 2`). The first worker to get here computes, in a fresh
    directory shared by the run's workers, and leaves the result pickled there; the others wait
    for it (a file lock) and load it. A compute that raises leaves nothing: the next worker tries
    again (and fails the same way, so each worker's tests report it). Without xdist: computed here,
    in a fresh directory of this session."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute(tmp_path_factory.mktemp(name))
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent  # the run's base: one per run, every worker's
    directory, done = shared / f"once-{name}", shared / f"once-{name}.pkl"
    with FileLock(str(shared / f"once-{name}.lock")):
        if done.is_file():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(directory, ignore_errors=True)  # what a failed compute left
        directory.mkdir()
        value = compute(directory)
        partial = done.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(done)
        return value
