"""python -m fusion_bridge [info|explain|parity|tune|bench|matrix] ...

With no arguments: `explain` for the built-in DeepSeek-V3 shape (H=7168, K=8, T=16) on this machine.
With --json, stdout carries only the JSON document; logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..environment import detect
from ..planner import NoStrategyAvailable, select, static_statuses
from ..report import Report
from ..spec import DTYPE_BY_NAME, EpilogueSpec, QuantSpec

DEEPSEEK_V3 = {"hidden": 7168, "top_k": 8}
DEFAULT_FP8_SCALE = 0.05           # divisor: |norm_out| up to ~22 fits e4m3's 448
DEFAULT_NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # multiplier for |norm_out| up to ~8


def _spec_args(p: argparse.ArgumentParser, tokens_default: int) -> None:
    p.add_argument("--hidden", type=int, default=DEEPSEEK_V3["hidden"], help="hidden size H (default 7168)")
    p.add_argument("--top-k", type=int, default=DEEPSEEK_V3["top_k"], help="experts per token K (default 8)")
    p.add_argument("--tokens", type=int, default=tokens_default, help=f"tokens T (default {tokens_default})")
    p.add_argument("--dtype", choices=sorted(DTYPE_BY_NAME), default="bf16", help="activation dtype")
    p.add_argument("--max-tokens", type=int, default=8192, help="largest T per call; sizes workspaces")
    p.add_argument("--quant", choices=["none", "fp8", "nvfp4"], default="none", help="quantize norm_out")
    p.add_argument("--no-shared", action="store_true", help="no shared-expert output")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")


def _spec(args) -> EpilogueSpec:
    quant = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(DEFAULT_FP8_SCALE),
             "nvfp4": QuantSpec.nvfp4(DEFAULT_NVFP4_GLOBAL_SCALE)}[args.quant]
    return EpilogueSpec(hidden_size=args.hidden, top_k=args.top_k, dtype=DTYPE_BY_NAME[args.dtype],
                        has_shared_output=not args.no_shared, quant=quant, max_tokens=args.max_tokens)


_JSON_FD: list[int] = []  # the real stdout while --json sends everything else (C++ logs too) to stderr


def _emit(args, doc: dict, text: str) -> None:
    if args.json:
        sys.stdout.flush()
        os.write(_JSON_FD[0] if _JSON_FD else 1, (json.dumps(doc, indent=2) + "\n").encode())
    else:
        print(text)


def _stdout_to_stderr() -> None:
    """Keep stdout for the JSON document alone: FlashInfer's kernels print warnings to fd 1."""
    sys.stdout.flush()
    _JSON_FD.append(os.dup(1))
    os.dup2(2, 1)


def cmd_info(args) -> int:
    from ..bridge import FusionBridge
    spec = _spec(args)
    with FusionBridge(spec) as bridge:
        report = bridge.explain(args.tokens)
    doc = report.to_dict()
    doc = {"environment": doc["environment"], "strategies": doc["strategies"], "selected": doc.get("selected")}
    _emit(args, doc, str(report))
    return 0


def cmd_explain(args) -> int:
    env = detect(probe_flashinfer=True)
    changes = {"world_size": args.world_size}
    if args.sm is not None:
        changes.update(device_type="cuda", sm=args.sm, gpu_name=args.gpu or env.gpu_name or f"SM{args.sm} GPU")
    elif args.gpu is not None:
        changes.update(gpu_name=args.gpu)
    env = env.replace(**changes)
    spec = _spec(args)
    statuses = static_statuses(spec, env)
    try:
        plan = select(statuses, spec)
    except NoStrategyAvailable as exc:
        print(str(exc), file=sys.stderr)
        plan = None
    report = Report(env, spec, statuses, plan, tokens=args.tokens)
    _emit(args, report.to_dict(), str(report) + "\n(static checks only: no self-test ran for a described machine)")
    return 0 if plan else 1


def cmd_parity(args) -> int:
    from .parity import run_parity
    spec = _spec(args)
    if not args.json:
        print(f"parity: {args.world_size} rank(s), T={args.tokens}, H={spec.hidden_size}, K={spec.top_k}",
              file=sys.stderr)
    rows = run_parity(spec, args.tokens, args.world_size, args.seed,
                      weight_dtype=torch.float32 if args.weights == "fp32" else torch.bfloat16)
    text = "\n".join([f"{'strategy':18s} {'output':13s} {'rel_err':>10s} {'bound':>10s} {'max_abs':>10s}  ok"]
                     + [f"{r['strategy']:18s} {r['output']:13s} {r['rel_err']:10.3e} {r['bound']:10.3e} "
                        f"{r['max_abs_err']:10.3e}  {'yes' if r['passed'] else 'NO'}" for r in rows])
    _emit(args, {"results": rows, "world_size": args.world_size, "tokens": args.tokens}, text)
    return 0 if rows and all(r["passed"] for r in rows) else 1


def _require_gpus(world_size: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"--world-size {world_size} needs {world_size} CUDA GPU(s) (it times CUDA graphs), "
                         f"found {found}")


def _on_ranks(fn, world_size: int, *fn_args):
    from .launch import run_distributed
    if world_size == 1:
        return fn(0, 1, *fn_args)
    return run_distributed(fn, world_size, *fn_args, backend="nccl", timeout_s=3000)[0]


def cmd_tune(args) -> int:
    from .bench import tune_rank
    _require_gpus(args.world_size)
    table = _on_ranks(tune_rank, args.world_size, _spec(args), not args.json)
    lines = [f"tuned {table['gpu']} TP{table['world_size']}; cached at {table.get('path')}"]
    for b in table["plan"]["buckets"]:
        lines.append(f"  T <= {b['max_tokens']:6d}: {b['strategy']}:{b['variant']:10s} {b['measured_us']:.1f} us")
    _emit(args, table, "\n".join(lines))
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_rank, plot, rows_from, summary
    from .bench import write_csv
    _require_gpus(args.world_size)
    tokens = [2 ** i for i in range(args.max_tokens.bit_length()) if 2 ** i <= args.max_tokens]
    spec = _spec(args)
    result = _on_ranks(bench_rank, args.world_size, spec, tokens, not args.json)
    rows = rows_from(result, args.world_size)
    write_csv(args.csv, rows)
    png = plot(rows, args.csv.rsplit(".", 1)[0] + ".png",
               f"{result['gpu']} TP{args.world_size} H={spec.hidden_size} K={spec.top_k} {spec.dtype_name} "
               f"quant={spec.quant.kind.value}")
    table = summary(rows)
    text = [f"wrote {args.csv}" + (f" and {png}" if png else " (no matplotlib: no PNG)")]
    keys = list(table[0])
    text.append(" ".join(f"{k:>14s}" for k in keys))
    text += [" ".join(f"{str(line.get(k, '')):>14s}" for k in keys) for line in table]
    text.append(f"host overhead (eager, us per call): {result['overhead']}")
    _emit(args, {"csv": args.csv, "png": png, "summary": table, "overhead": result["overhead"],
                 "rows": rows}, "\n".join(text))
    return 0


def cmd_matrix(args) -> int:
    from .matrix import markdown, rows
    _emit(args, {"matrix": rows()}, markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fusion_bridge", description=(
        "The MoE epilogue bridge: which strategy runs, why the others don't, and whether they agree. "
        "Runs on CPU by default with the DeepSeek-V3 shape (H=7168, K=8)."))
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("info", help="this machine's environment and every strategy, with reasons")
    _spec_args(p, 16)
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("explain", help="what would be selected for a spec on a described machine")
    _spec_args(p, 16)
    p.add_argument("--world-size", type=int, default=1, help="TP group size to describe (default 1)")
    p.add_argument("--sm", type=int, default=None, help="describe a CUDA GPU of this SM (e.g. 90, 100)")
    p.add_argument("--gpu", default=None, help="describe a GPU by name (e.g. 'NVIDIA H200')")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("parity", help="every available strategy against the fp32 oracle")
    _spec_args(p, 16)
    p.add_argument("--world-size", type=int, default=1, help="ranks to spawn (gloo on CPU, NCCL on GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32", help="expert weight dtype")
    p.set_defaults(fn=cmd_parity)
    p = sub.add_parser("tune", help="measure every strategy per token bucket on this machine's GPUs and cache "
                                    "the plan (needs CUDA)")
    _spec_args(p, 16)
    p.add_argument("--world-size", type=int, default=1, help="ranks (one GPU each, NCCL)")
    p.set_defaults(fn=cmd_tune)
    p = sub.add_parser("bench", help="time every strategy and auto for T = 1, 2, 4, ... (needs CUDA); "
                                     "CSV + PNG")
    _spec_args(p, 16)
    p.add_argument("--world-size", type=int, default=1, help="ranks (one GPU each, NCCL)")
    p.add_argument("--csv", default="benchmarks/results/epilogue.csv", help="output CSV (PNG beside it)")
    p.set_defaults(fn=cmd_bench, max_tokens=4096)
    p = sub.add_parser("matrix", help="compatibility matrix generated from the registry (markdown)")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.set_defaults(fn=cmd_matrix)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv or ["explain"])
    if args.command is None:
        args = parser.parse_args(["explain", *argv])
    if getattr(args, "json", False):
        _stdout_to_stderr()
    try:
        return args.fn(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
