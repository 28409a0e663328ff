"""python -m fusion_bridge [info|explain|parity|tune|bench|matrix] ...   (also installed as `fusion-bridge`)

With no arguments: `explain` for the built-in DeepSeek-V3 shape (H=7168, K=8, T=16) on this machine.
With --json, stdout carries only the JSON document; logs and progress go to stderr.

Every argument is checked by the parser (a one-line error, exit status 2). torch and the rest of the
library are imported only when a command runs, so `--help` and `--version` stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .. import __version__

SCHEMA_VERSION = 1  # of every JSON document the CLI prints
STRATEGY_ENV = "FUSION_BRIDGE_STRATEGY"
DEEPSEEK_V3 = {"hidden": 7168, "top_k": 8}
DTYPES = ("bf16", "fp16")          # fusion_bridge.spec.DTYPE_BY_NAME (a test keeps them equal)
QUANTS = ("none", "fp8", "nvfp4")
DEFAULT_FP8_SCALE = 0.05           # divisor: |norm_out| up to ~22 fits e4m3's 448
DEFAULT_NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # multiplier for |norm_out| up to ~8
SM_RANGE = (70, 200)               # Volta (SM70) up to anything plausible after Blackwell (SM100-121)
MAX_GLOO_RANKS = 8                 # parity on CPU: one torch process per rank
# GPU name -> SM, for `explain --gpu NAME` without --sm. Matched as a whole word in the name
# ('NVIDIA H200', 'NVIDIA H100 80GB HBM3'; 'GH200' is its own entry, not 'H200').
KNOWN_GPUS = {"A100": 80, "A800": 80, "H100": 90, "H800": 90, "H200": 90, "H20": 90, "GH200": 90,
              "B200": 100, "GB200": 100}


# ------------------------------------------------------------------ argument types (one-line errors)
def _int_in(low: int, high: int | None = None, what: str = "an integer"):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = what  # argparse names the type in its "invalid ... value" message
    return parse


def gloo_rank_limit() -> int:
    return max(1, min(MAX_GLOO_RANKS, os.cpu_count() or 1))


def _parity_world_size(text: str) -> int:
    """Ranks `parity` can spawn here: one per visible GPU (NCCL), else min(8, CPU cores) (gloo)."""
    value = _int_in(1)(text)
    import torch  # only when this argument is given: --help stays fast
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        if value > gpus:
            raise argparse.ArgumentTypeError(f"must be at most {gpus} here (one rank per GPU, NCCL; "
                                             f"{gpus} visible), got {value}")
    elif value > gloo_rank_limit():
        raise argparse.ArgumentTypeError(f"must be at most {gloo_rank_limit()} here (gloo on CPU: one process "
                                         f"per rank, at most min({MAX_GLOO_RANKS}, {os.cpu_count()} CPU cores)), "
                                         f"got {value}")
    return value


def sm_of_gpu(name: str) -> int | None:
    for model, sm in KNOWN_GPUS.items():
        if re.search(rf"(?<![A-Za-z0-9]){model}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return sm
    return None


def _gpu_name(text: str) -> str:
    """The name as torch.cuda.get_device_name() reports it; 'H200' is read as 'NVIDIA H200'."""
    name = " ".join(text.split())
    if not name:
        raise argparse.ArgumentTypeError("expected a GPU name such as 'NVIDIA H200', got an empty string")
    if sm_of_gpu(name) is not None and not name.upper().startswith("NVIDIA "):
        name = f"NVIDIA {name}"
    return name


# ------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    pass


def _spec_args(p: argparse.ArgumentParser, tokens_default: int | None, min_tokens: int = 0,
               max_tokens_default: int = 8192) -> None:
    p.add_argument("--hidden", type=_int_in(1), default=DEEPSEEK_V3["hidden"], help="hidden size H")
    p.add_argument("--top-k", type=_int_in(1), default=DEEPSEEK_V3["top_k"], help="experts per token K")
    if tokens_default is not None:
        p.add_argument("--tokens", type=_int_in(min_tokens), default=tokens_default,
                       help=f"tokens T of the call to describe (>= {min_tokens})")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="activation dtype")
    p.add_argument("--max-tokens", type=_int_in(1), default=max_tokens_default,
                   help="largest T per call; sizes workspaces")
    p.add_argument("--quant", choices=QUANTS, default="none", help="quantize norm_out")
    p.add_argument("--no-shared", action="store_true", help="no shared-expert output")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")


def build_parser() -> argparse.ArgumentParser:
    prog = "fusion-bridge" if os.path.basename(sys.argv[0]) == "fusion-bridge" else "python -m fusion_bridge"
    parser = _Parser(prog=prog, formatter_class=_Formatter, description=(
        "The MoE epilogue bridge: which strategy runs, why the others don't, and whether they agree. "
        "Runs on CPU by default with the DeepSeek-V3 shape (H=7168, K=8). Without a command: explain."),
        epilog=f"Environment: {STRATEGY_ENV}=<name> requests a strategy (info reports whether it can run).")
    parser.add_argument("--version", action="version", version=f"fusion-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=description, formatter_class=_Formatter)
        p.set_defaults(subparser=p)  # for the checks that involve two arguments
        return p

    p = command("info", "this machine: environment and every strategy, with reasons and self-test",
                "Build a bridge on this machine (one process, strategy auto) and report the environment, every "
                f"strategy with all its reasons and its self-test state, and the plan. When {STRATEGY_ENV} is "
                "set, also say whether that strategy can run here and why not; info still exits 0.")
    _spec_args(p, 16)
    p.set_defaults(fn=cmd_info)

    p = command("explain", "the plan for a spec on this or a described machine (static checks)",
                "Run every strategy's static checks for a spec on a machine (this one, or one described with "
                "--gpu/--sm/--world-size) and show the plan. On a GPU with a shipped tuning table for that GPU "
                "name, world size and spec, the plan uses the table's measurements, as a bridge would. "
                f"--gpu alone implies the SM of known GPUs ({', '.join(f'{k} {v}' for k, v in KNOWN_GPUS.items())}); "
                "other names need --sm. No self-test and no workspace: those need a bridge (see info).")
    _spec_args(p, 16)
    p.add_argument("--world-size", type=_int_in(1), default=1, help="TP group size to describe (>= 1)")
    p.add_argument("--sm", type=_int_in(*SM_RANGE, what="an SM number such as 90"), default=None,
                   help=f"describe a CUDA GPU of this SM ({SM_RANGE[0]}..{SM_RANGE[1]}, e.g. 90 for H100/H200, "
                        "100 for B200)")
    p.add_argument("--gpu", type=_gpu_name, default=None,
                   help="describe a GPU by name, e.g. 'NVIDIA H200' (selects its shipped tuning table)")
    p.set_defaults(fn=cmd_explain)

    p = command("parity", "every available strategy against the fp32 oracle",
                "Spawn --world-size ranks on this machine, run every strategy that can run here on fresh random "
                "inputs (different per rank) and compare each output with the fp32 oracle. Lists the strategies "
                "it skipped, with their reason codes.")
    _spec_args(p, 16, min_tokens=1)
    p.add_argument("--world-size", type=_parity_world_size, default=1,
                   help="ranks to spawn: with CUDA one per GPU (NCCL), at most the visible GPU count; on CPU gloo, "
                        f"at most min({MAX_GLOO_RANKS}, CPU cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32", help="expert weight dtype")
    p.set_defaults(fn=cmd_parity)

    p = command("tune", "measure every strategy per token bucket and cache the plan (CUDA)",
                "Time every (strategy, launch variant) at each token bucket 1, 2, 4, ... up to --max-tokens on "
                "this machine's GPUs (one rank per GPU, NCCL), cache the table and print the plan.")
    _spec_args(p, None)
    p.add_argument("--world-size", type=_int_in(1), default=1, help="ranks (one GPU each, NCCL)")
    p.set_defaults(fn=cmd_tune)

    p = command("bench", "time every strategy and auto for T = 1, 2, 4, ... (CUDA); CSV + PNG",
                "Benchmark every strategy and auto for T = 1, 2, 4, ... up to --max-tokens, inputs rotated beyond "
                "L2 and replayed; write a long-format CSV and, with matplotlib, a PNG beside it.")
    _spec_args(p, None, max_tokens_default=4096)
    p.add_argument("--world-size", type=_int_in(1), default=1, help="ranks (one GPU each, NCCL)")
    p.add_argument("--csv", default="benchmarks/results/epilogue.csv", help="output CSV (PNG beside it)")
    p.set_defaults(fn=cmd_bench)

    p = command("matrix", "compatibility matrix generated from the registry (markdown)",
                "Evaluate every strategy's capability checks over described machines and print the "
                "compatibility matrix the README embeds.")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.set_defaults(fn=cmd_matrix)
    return parser


def _check_combinations(parser: argparse.ArgumentParser, args) -> None:
    """Checks that involve two arguments, with the parser's one-line errors."""
    if getattr(args, "gpu", None) is not None:
        known = sm_of_gpu(args.gpu)
        if args.sm is None and known is None:
            parser.error(f"--gpu {args.gpu!r} is not a GPU whose SM is known here "
                         f"({', '.join(KNOWN_GPUS)}): give --sm too")
        if args.sm is not None and known is not None and args.sm != known:
            parser.error(f"--sm {args.sm} contradicts --gpu {args.gpu!r} (SM {known})")
    raw = os.environ.get(STRATEGY_ENV)
    if raw:
        from ..registry import REGISTRY
        if raw != "auto" and raw not in REGISTRY:
            parser.error(f"{STRATEGY_ENV}={raw!r} is not a strategy: use 'auto' or one of {', '.join(REGISTRY)}")


# ------------------------------------------------------------------ output
_JSON_FD: list[int] = []  # the real stdout while --json sends everything else (C++ logs too) to stderr


def _emit(args, doc: dict, text: str) -> None:
    if args.json:
        doc = {"schema_version": SCHEMA_VERSION, "command": args.command, **doc}
        sys.stdout.flush()
        os.write(_JSON_FD[0] if _JSON_FD else 1, (json.dumps(doc, indent=2) + "\n").encode())
    else:
        print(text)


def _stdout_to_stderr() -> None:
    """Keep stdout for the JSON document alone: FlashInfer's kernels print warnings to fd 1."""
    sys.stdout.flush()
    _JSON_FD.append(os.dup(1))
    os.dup2(2, 1)


def _spec(args):
    from ..spec import DTYPE_BY_NAME, EpilogueSpec, QuantSpec
    quant = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(DEFAULT_FP8_SCALE),
             "nvfp4": QuantSpec.nvfp4(DEFAULT_NVFP4_GLOBAL_SCALE)}[args.quant]
    return EpilogueSpec(hidden_size=args.hidden, top_k=args.top_k, dtype=DTYPE_BY_NAME[args.dtype],
                        has_shared_output=not args.no_shared, quant=quant, max_tokens=args.max_tokens)


def _env_request(statuses) -> dict | None:
    """What FUSION_BRIDGE_STRATEGY asks for and whether it can run, or None when unset."""
    raw = os.environ.get(STRATEGY_ENV)
    if not raw:
        return None
    status = next((s for s in statuses if s.name == raw), None)
    return {"variable": STRATEGY_ENV, "value": raw, "available": True if status is None else status.available,
            "reasons": [r.to_dict() for r in status.reasons] if status else []}


def _env_request_text(req: dict | None) -> list[str]:
    if req is None:
        return []
    head = f"{req['variable']}={req['value']}"
    if req["available"]:
        return [f"{head}: can run here (a bridge built with it runs it for every T)"]
    return [f"{head}: cannot run here, a bridge built with it raises:"] + [
        f"  [{r['code']}] {r['message']}" for r in req["reasons"]]


# ------------------------------------------------------------------ commands
def cmd_info(args) -> int:
    from ..bridge import FusionBridge
    spec = _spec(args)
    # info diagnoses: build with "auto" whatever the variable asks, and report the request separately
    raw = os.environ.pop(STRATEGY_ENV, None)
    try:
        with FusionBridge(spec) as bridge:
            report = bridge.explain(args.tokens)
    finally:
        if raw is not None:
            os.environ[STRATEGY_ENV] = raw
    req = _env_request(report.strategies)
    _emit(args, {**report.to_dict(), "env_strategy": req}, "\n".join([str(report), *_env_request_text(req)]))
    return 0


def _static_self_test(statuses) -> list:
    """explain builds nothing: say so in each status's self-test state."""
    import dataclasses
    from ..registry import strategy_class
    return [dataclasses.replace(s, self_test="not needed" if not strategy_class(s.name).self_tested
                                else "not run (static checks only)") for s in statuses]


def cmd_explain(args) -> int:
    from ..environment import detect
    from ..planner import AUTO, NoStrategyAvailable, select, static_statuses
    from ..report import Report
    from .. import tuning
    env = detect(probe_flashinfer=True)
    described = args.sm is not None or args.gpu is not None or args.world_size != 1
    changes = {"world_size": args.world_size}
    if args.gpu is not None or args.sm is not None:
        # a described GPU machine runs as documented: multicast variables set in every rank, and a CUDA
        # torch whose symmetric memory works (this process's CPU torch and environment say nothing of it)
        changes.update(device_type="cuda", sm=args.sm if args.sm is not None else sm_of_gpu(args.gpu),
                       gpu_name=args.gpu, multicast_off=True, symm_mem_error=None, triton_interpret=False)
    env = env.replace(**changes)
    spec = _spec(args)
    statuses = _static_self_test(static_statuses(spec, env))
    table, table_line = None, None
    if env.device_type == "cuda":
        path = tuning.default_table_path(spec, env)
        if path.is_file():
            table = tuning.read_table(path)
        if table is None:
            table_line = (f"no tuning table ships for {env.gpu_name or f'SM{env.sm}'} TP{env.world_size} with this "
                          "spec: static order")
    requested = os.environ.get(STRATEGY_ENV) or AUTO
    try:
        plan = select(statuses, spec, requested, tuning.as_measurements(table) if table else None)
    except NoStrategyAvailable as exc:
        print(str(exc), file=sys.stderr)
        plan = None
    report = Report(env, spec, statuses, plan, tokens=args.tokens, table=table["path"] if table else None)
    req = _env_request(statuses)
    lines = [str(report)] + ([table_line] if table_line else []) + _env_request_text(req)
    if described:
        lines.append("(a described machine: static checks only, no self-test, no workspace)")
    _emit(args, {**report.to_dict(), "env_strategy": req}, "\n".join(lines))
    return 0 if plan else 1


def cmd_parity(args) -> int:
    import torch
    from .parity import run_parity_report
    spec = _spec(args)
    if not args.json:
        print(f"parity: {args.world_size} rank(s), T={args.tokens}, H={spec.hidden_size}, K={spec.top_k}",
              file=sys.stderr)
    rows, skipped = run_parity_report(spec, args.tokens, args.world_size, args.seed,
                                      weight_dtype=torch.float32 if args.weights == "fp32" else torch.bfloat16)
    text = [f"{'strategy':18s} {'output':13s} {'rel_err':>10s} {'bound':>10s} {'max_abs':>10s}  ok"]
    text += [f"{r['strategy']:18s} {r['output']:13s} {r['rel_err']:10.3e} {r['bound']:10.3e} "
             f"{r['max_abs_err']:10.3e}  {'yes' if r['passed'] else 'NO'}" for r in rows]
    if skipped:
        text.append("skipped (cannot run here):")
        text += [f"  {name:22s} {', '.join(codes)}" for name, codes in skipped.items()]
    _emit(args, {"results": rows, "skipped": skipped, "world_size": args.world_size, "tokens": args.tokens},
          "\n".join(text))
    return 0 if rows and all(r["passed"] for r in rows) else 1


def _require_gpus(world_size: int) -> None:
    import torch
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
    _emit(args, {"table": table}, "\n".join(lines))
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_rank, plot, rows_from, summary, write_csv
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
    # hand-written tables (here, in parity and in matrix): tabulate comes only with the optional flashinfer
    # extra, not with torch/triton, and parity and matrix run on CPU installs without it
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["explain", *argv]  # no command: explain (with any options given)
    args = parser.parse_args(argv)
    _check_combinations(args.subparser, args)
    if getattr(args, "json", False):
        _stdout_to_stderr()
    try:
        return args.fn(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
