"""Test-only helpers."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings
from typing import NamedTuple

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs


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
        if not torch.equal(q, ref):
            bad = (q != ref).nonzero()[:4].tolist()
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
