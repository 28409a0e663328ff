"""python -m fusion_bridge [info|explain|parity|tune|bench|matrix] ... (also installed
as `fusion-bridge`)

With no arguments: `explain` for the built-in DeepSeek-V3 shape (H=7168, K=8, T=16) on this machine.
With --json, stdout carries only the JSON document; logs and progress go to stderr.

Every argument is checked by the parser (a one-line error, exit status 2). torch and the rest of the
library are imported only when a command runs, so `--help` and `--version` stay fast.
tune and bench live in timing_commands.py; what every command shares (spec, output) in common.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from fusion_bridge import __version__
from fusion_bridge.cli.args import STRATEGY_ENV, build_parser, check_combinations, sm_of_gpu

# re-exported: what the parser accepts
from fusion_bridge.cli.args import DTYPES, QUANTS, gloo_rank_limit  # noqa: F401
from fusion_bridge.cli.common import (
    check_memory,
    check_spec,
    emit,
    set_multicast_off,
    spec_from_args,
    stdout_to_stderr,
    versions,
)
from fusion_bridge.cli.timing_commands import cmd_bench, cmd_tune


def _env_request(statuses) -> dict | None:
    """What FUSION_BRIDGE_STRATEGY asks for and whether it can run, or None when unset."""
    raw = os.environ.get(STRATEGY_ENV)
    if not raw:
        return None
    status = next((s for s in statuses if s.name == raw), None)
    return {
        "variable": STRATEGY_ENV,
        "value": raw,
        "available": True if status is None else status.available,
        "reasons": [r.to_dict() for r in status.reasons] if status else [],
    }


def _env_request_text(req: dict | None) -> list[str]:
    if req is None:
        return []
    head = f"{req['variable']}={req['value']}"
    if req["available"]:
        return [f"{head}: can run here (a bridge built with it runs it for every T)"]
    return [f"{head}: cannot run here, a bridge built with it raises:"] + [
        f"  [{r['code']}] {r['message']}" for r in req["reasons"]
    ]


# ------------------------------------------------------------------ commands
def cmd_info(args) -> int:
    from fusion_bridge import FusionBridge

    spec = spec_from_args(args)
    # info diagnoses: build with "auto" whatever the variable asks, and report the
    # request separately
    raw = os.environ.pop(STRATEGY_ENV, None)
    try:
        with FusionBridge(spec) as bridge:
            report = bridge.explain(args.tokens)
    finally:
        if raw is not None:
            os.environ[STRATEGY_ENV] = raw
    req = _env_request(report.strategies)
    emit(
        args,
        {**report.to_dict(), "env_strategy": req, "assumed": []},  # this machine: probed
        "\n".join([report.machine_text(), *_env_request_text(req)]),
    )
    return 0


def _static_self_test(statuses) -> list:
    """explain builds nothing: say so in each status's self-test state."""
    import dataclasses
    from fusion_bridge.strategies import strategy_class

    return [
        dataclasses.replace(
            s,
            self_test="not needed"
            if not strategy_class(s.name).self_tested
            else "not run (static checks only)",
        )
        for s in statuses
    ]


def cmd_explain(args) -> int:
    from fusion_bridge.environment import detect
    from fusion_bridge.plan.planner import (
        AUTO,
        NoStrategyAvailable,
        check_exclusions,
        exclude,
        select,
        static_statuses,
    )
    from fusion_bridge.plan.report import Report
    from fusion_bridge.tuning import tables as tuning

    env = detect(probe_flashinfer=True)
    described = args.sm is not None or args.gpu is not None or args.world_size != 1
    changes = {"world_size": args.world_size}
    if args.gpu is not None or args.sm is not None:
        # a described GPU machine runs as documented: every strategy's probe takes its documented
        # value (this process's CPU torch and environment say nothing of that machine)
        changes.update(
            device_type="cuda",
            sm=args.sm if args.sm is not None else sm_of_gpu(args.gpu),
            gpu_name=args.gpu,
            probes={},
            triton_interpret=False,
        )
    env = env.replace(**changes)
    spec = spec_from_args(args)
    statuses = _static_self_test(static_statuses(spec, env))
    raw_exclude = os.environ.get("FUSION_BRIDGE_EXCLUDE", "")
    names = [n.strip() for n in raw_exclude.split(",") if n.strip()]
    if names:  # as a bridge would: kept out of auto, reported as excluded by request
        requested_here = os.environ.get(STRATEGY_ENV) or AUTO
        known = [st.name for st in statuses]
        names = check_exclusions(names, known, requested_here, "FUSION_BRIDGE_EXCLUDE")
        statuses = exclude(statuses, names, "FUSION_BRIDGE_EXCLUDE")
    table, table_line = None, None
    if env.device_type == "cuda":
        path = tuning.default_table_path(spec, env)
        if path.is_file():  # as a bridge reads it: measured for this GPU, world size and spec
            table = tuning.read_table(path, tuning.table_expectation(spec, env))
        if table is None:
            table_line = (
                f"no tuning table ships for {env.gpu_name or f'SM{env.sm}'} TP{env.world_size} "
                "with this "
                "spec: static order"
            )
    requested = os.environ.get(STRATEGY_ENV) or AUTO
    try:
        plan = select(
            statuses,
            spec,
            requested,
            tuning.as_measurements(table) if table else None,
            tuning.margin_of(table),
        )
    except NoStrategyAvailable as exc:
        print(str(exc), file=sys.stderr)
        plan = None
    report = Report(
        env, spec, statuses, plan, tokens=args.tokens, table=table["path"] if table else None
    )
    req = _env_request(statuses)
    assumed = _assumptions(env, table) if described else []
    lines = [str(report)] + ([table_line] if table_line else []) + _env_request_text(req)
    if described:
        lines.append("(a described machine: static checks only, no self-test, no workspace)")
        lines += ["assumed for it:"] + [f"  {a}" for a in assumed]
    emit(args, {**report.to_dict(), "env_strategy": req, "assumed": assumed}, "\n".join(lines))
    return 0 if plan else 1


def _assumptions(env, table) -> list[str]:
    """What `explain` takes for granted about a described machine (it cannot probe it)."""
    out = [f"world size {env.world_size}, every rank on one node"]
    if env.device_type == "cuda":
        torch_version = env.torch_version.split("+")[0]
        triton, flashinfer = env.triton_version or "missing", env.flashinfer_version or "missing"
        out += [
            f"a CUDA build of torch {torch_version} whose symmetric memory works, triton {triton} "
            f"and flashinfer {flashinfer} (the versions installed here)",
            "multicast: not needed by any strategy (our kernels never use it), so not assumed "
            "either way",
        ]
        if table is not None:
            versions = table.get("versions", {})
            out.append(
                "the tuning table's times: measured with NCCL NVLS and NVLink multicast off, "
                f"torch {versions.get('torch')}, flashinfer {versions.get('flashinfer')}"
            )
    return out


def cmd_parity(args) -> int:
    import torch

    if torch.cuda.is_available():
        set_multicast_off("parity")
    interpreted = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
    if interpreted:  # our Triton kernels (local_fused_nccl) then run on CPU too, in every rank
        os.environ["TRITON_INTERPRET"] = "1"
    from fusion_bridge.cli.parity import run_parity_report

    if os.environ.get(STRATEGY_ENV, "").strip() == "reference":
        raise ValueError(
            f"parity compares strategies with the reference, and {STRATEGY_ENV}=reference leaves "
            "nothing to compare: unset it, or set it to the strategy to compare"
        )
    spec = spec_from_args(args)
    if not args.json:
        print(
            f"parity: {args.world_size} rank(s), T={args.tokens}, H={spec.hidden_size}, "
            f"K={spec.top_k}"
            + (", our Triton kernels under the interpreter (CPU; slower)" if interpreted else ""),
            file=sys.stderr,
        )
    rows, skipped = run_parity_report(
        spec,
        args.tokens,
        args.world_size,
        args.seed,
        weight_dtype=torch.float32 if args.weights == "fp32" else torch.bfloat16,
    )
    text = [f"{'strategy':18s} {'output':13s} {'rel_err':>10s} {'bound':>10s} {'max_abs':>10s}  ok"]
    text += [
        f"{r['strategy']:18s} {r['output']:13s} {r['rel_err']:10.3e} {r['bound']:10.3e} "
        f"{r['max_abs_err']:10.3e}  {'yes' if r['passed'] else 'NO'}"
        for r in rows
    ]
    if skipped:
        text.append("skipped (cannot run here):")
        text += [f"  {name:22s} {', '.join(codes)}" for name, codes in skipped.items()]
    emit(
        args,
        {
            "results": rows,
            "skipped": skipped,
            "world_size": args.world_size,
            "tokens": args.tokens,
            "seed": args.seed,
            "weights": args.weights,
            "spec": spec.to_dict(),
            "versions": versions(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        },
        "\n".join(text),
    )
    return 0 if rows and all(r["passed"] for r in rows) else 1


def cmd_matrix(args) -> int:
    from fusion_bridge.cli.matrix import markdown, rows

    emit(args, {"matrix": rows()}, markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(
        {
            "info": cmd_info,
            "explain": cmd_explain,
            "parity": cmd_parity,
            "tune": cmd_tune,
            "bench": cmd_bench,
            "matrix": cmd_matrix,
        }
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if sorted(argv) == ["--json", "--version"]:  # the version as every command's JSON document
        emit(argparse.Namespace(json=True, command="version"), {"version": __version__}, "")
        return 0
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["explain", *argv]  # no command: explain (with any options given)
    args = parser.parse_args(argv)
    check_combinations(args.subparser, args)
    if args.command in ("explain", "parity"):
        check_spec(args.subparser, args)
    if args.command == "parity":
        check_memory(args.subparser, args)
    if getattr(args, "json", False):
        stdout_to_stderr()
    try:
        from fusion_bridge import env_vars, log

        env_vars.check_all()  # a malformed FUSION_BRIDGE_* variable: one line naming it
        log.configure_once()
        code = args.fn(args)
        if sys.stdout is not None:  # None: started with stdout closed
            sys.stdout.flush()  # a write error surfaces here, not in the interpreter's exit
        return code
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed (`| head`): the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a full disk, a closed or unwritable output
        _quiet_stdout()
        print(f"error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the launcher has already ended every rank it started
        print("interrupted", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what could not be written
    raises nothing more."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
