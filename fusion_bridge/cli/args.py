"""The CLI's arguments: the parser, its argument types (one-line errors, exit status 2) and the
checks that involve two arguments. Imports nothing heavy, so `--help` and `--version` stay fast."""

from __future__ import annotations

import argparse
import os
import re
import sys

from fusion_bridge import __version__

SCHEMA_VERSION = 1  # of every JSON document the CLI prints
# parity materialises K+5 [T, H] tensors per rank and the fp32 oracle: 16384 tokens at H=7168, K=8
# is about 3.5 GB per rank on CPU, the most a developer machine should be asked for
PARITY_MAX_TOKENS = 16384
STRATEGY_ENV = "FUSION_BRIDGE_STRATEGY"
DEEPSEEK_V3 = {"hidden": 7168, "top_k": 8}
DTYPES = ("bf16", "fp16")  # fusion_bridge.spec.DTYPE_BY_NAME (a test keeps them equal)
QUANTS = ("none", "fp8", "nvfp4", "fp8_per_token_group", "fp8_per_token")
SCALE_LAYOUTS = ("row_major", "column_major", "column_major_tma")  # spec.ScaleLayout's values
DEFAULT_GROUP_SIZE = 128
SF_LAYOUTS = ("swizzled_128x4", "linear")  # fusion_bridge.spec.SFLayout's values
DEFAULT_FP8_SCALE = 0.05  # divisor: |norm_out| up to ~22 fits e4m3's 448
DEFAULT_NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # multiplier for |norm_out| up to ~8
SM_RANGE = (70, 200)  # Volta (SM70) up to anything plausible after Blackwell (SM100-121)
MAX_GLOO_RANKS = 8  # parity on CPU: one torch process per rank
# GPU name -> SM, for `explain --gpu NAME` without --sm. Matched as a whole word in the name
# ('NVIDIA H200', 'NVIDIA H100 80GB HBM3'; 'GH200' is its own entry, not 'H200').
KNOWN_GPUS = {
    "A100": 80,
    "A800": 80,
    "H100": 90,
    "H800": 90,
    "H200": 90,
    "H20": 90,
    "GH200": 90,
    "B200": 100,
    "GB200": 100,
}


# ------------------------------------------------------------------ argument types, one-line errors
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


def _real(what: str):
    """A float argument (its range is the spec's to check: check_spec names the flag)."""

    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = what
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
            raise argparse.ArgumentTypeError(
                f"must be at most {gpus} here (one rank per GPU, NCCL; {gpus} visible), got {value}"
            )
    elif value > gloo_rank_limit():
        raise argparse.ArgumentTypeError(
            f"must be at most {gloo_rank_limit()} here (gloo on CPU: one process "
            f"per rank, at most min({MAX_GLOO_RANKS}, {os.cpu_count()} CPU cores)), "
            f"got {value}"
        )
    return value


def _model_pattern(model: str) -> str:
    return rf"(?<![A-Za-z0-9]){model}(?![A-Za-z0-9])"


def sm_of_gpu(name: str) -> int | None:
    for model, sm in KNOWN_GPUS.items():
        if re.search(_model_pattern(model), name, re.IGNORECASE):
            return sm
    return None


def _gpu_name(text: str) -> str:
    """The name as torch.cuda.get_device_name() reports it: 'H200' and 'nvidia h200' are read as
    'NVIDIA H200' (tuning tables are keyed by the exact name, so the spelling must be torch's)."""
    name = " ".join(text.split())
    if not name:
        raise argparse.ArgumentTypeError(
            "expected a GPU name such as 'NVIDIA H200', got an empty string"
        )
    for model in KNOWN_GPUS:
        if re.search(_model_pattern(model), name, re.IGNORECASE):
            name = re.sub(_model_pattern(model), model, name, flags=re.IGNORECASE)
            name = re.sub(r"^nvidia ", "", name, flags=re.IGNORECASE)
            return f"NVIDIA {name}"
    return name


# ------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    pass


def _spec_args(
    p: argparse.ArgumentParser,
    tokens_default: int | None,
    min_tokens: int = 0,
    max_tokens_default: int = 8192,
    tokens_limit: int | None = None,
) -> None:
    p.add_argument("--hidden", type=_int_in(1), default=DEEPSEEK_V3["hidden"], help="hidden size H")
    p.add_argument(
        "--top-k", type=_int_in(1), default=DEEPSEEK_V3["top_k"], help="experts per token K"
    )
    if tokens_default is not None:
        p.add_argument(
            "--tokens",
            type=_int_in(min_tokens, tokens_limit),
            default=tokens_default,
            help=f"tokens T of the call (>= {min_tokens}"
            + (f", <= {tokens_limit}: the inputs are materialised" if tokens_limit else "")
            + ")",
        )
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="activation dtype")
    p.add_argument(
        "--max-tokens",
        type=_int_in(1),
        default=max_tokens_default,
        help="largest T per call; sizes workspaces",
    )
    p.add_argument("--quant", choices=QUANTS, default="none", help="quantize norm_out")
    p.add_argument(
        "--quant-scale",
        type=_real("a number"),
        default=None,
        help="fp8: the divisor `scale` (codes = e4m3(norm_out / scale); default "
        f"{DEFAULT_FP8_SCALE}); nvfp4: the multiplier `global_scale` (default "
        f"{DEFAULT_NVFP4_GLOBAL_SCALE}); not with --quant none",
    )
    p.add_argument(
        "--sf-layout",
        choices=SF_LAYOUTS,
        default=None,
        help=f"nvfp4 block scales' layout (default {SF_LAYOUTS[0]}: FlashInfer's 128x4 swizzle; "
        "linear: [T, H/16]); nvfp4 only",
    )
    p.add_argument(
        "--group-size",
        type=_int_in(1),
        default=None,
        help=f"fp8_per_token_group: elements per scale, a power of two dividing --hidden (default "
        f"{DEFAULT_GROUP_SIZE}); fp8_per_token_group only",
    )
    p.add_argument(
        "--scale-layout",
        choices=SCALE_LAYOUTS,
        default=None,
        help=f"fp8_per_token_group: the fp32 scales' layout (default {SCALE_LAYOUTS[0]}: [T, H/g]; "
        "column_major: the transpose of [H/g, T]; column_major_tma: of [H/g, round_up(T, 4)], "
        "DeepGEMM's); fp8_per_token_group only",
    )
    p.add_argument(
        "--eps",
        type=_real("a number such as 1e-6"),
        default=1e-6,
        help="RMSNorm epsilon, added to the mean square",
    )
    p.add_argument(
        "--weight-bias",
        type=_real("a number such as 1.0"),
        default=0.0,
        help="added to gamma before it multiplies: 1.0 for a Gemma-style norm storing a "
        "zero-centred weight, 0.0 when gamma is the multiplier as applied",
    )
    p.add_argument(
        "--routed-scaling-factor",
        type=_real("a number such as 2.5"),
        default=1.0,
        help="the factor still to apply to the top-k sum: 1.0 where the routing weights already "
        "carry the model's factor (then never the model's value: it would apply twice)",
    )
    p.add_argument("--no-shared", action="store_true", help="no shared-expert output")
    p.add_argument(
        "--shared-output-replicated",
        action="store_true",
        help="the shared output is the whole shared expert's output on every rank (added once, "
        "from rank 0) rather than each rank's partial (summed over the ranks)",
    )
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """commands: subcommand name -> the function that runs it (cli/main.py's cmd_*)."""
    prog = (
        "fusion-bridge"
        if os.path.basename(sys.argv[0]) == "fusion-bridge"
        else "python -m fusion_bridge"
    )
    parser = _Parser(
        prog=prog,
        formatter_class=_Formatter,
        description=(
            "The MoE epilogue bridge: which strategy runs, why the others don't, and whether they "
            "agree. "
            "Runs on CPU by default with the DeepSeek-V3 shape (H=7168, K=8). Without a command: "
            "explain."
        ),
        epilog=f"Environment: {STRATEGY_ENV}=<name> requests a strategy (info reports whether it "
        "can run).",
    )
    parser.add_argument("--version", action="version", version=f"fusion-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=description, formatter_class=_Formatter)
        p.set_defaults(subparser=p)  # for the checks that involve two arguments
        return p

    p = command(
        "info",
        "this machine: environment and every strategy, with reasons and self-test",
        "Build a bridge on this machine (one process, strategy auto) and report the environment, "
        "every "
        f"strategy with all its reasons and its self-test state, and the plan. When {STRATEGY_ENV} "
        "is "
        "set, also say whether that strategy can run here and why not; info still exits 0.",
    )
    _spec_args(p, 16)
    p.set_defaults(fn=commands["info"])

    p = command(
        "explain",
        "the plan for a spec on this or a described machine (static checks)",
        "Run every strategy's static checks for a spec on a machine (this one, or one described "
        "with "
        "--gpu/--sm/--world-size) and show the plan. On a GPU with a shipped tuning table for that "
        "GPU "
        "name, world size and spec, the plan uses the table's measurements, as a bridge would. "
        "--gpu alone implies the SM of known GPUs "
        f"({', '.join(f'{k} {v}' for k, v in KNOWN_GPUS.items())}); "
        "other names need --sm. No self-test and no workspace: those need a bridge (see info).",
    )
    _spec_args(p, 16)
    p.add_argument(
        "--world-size", type=_int_in(1), default=1, help="TP group size to describe (>= 1)"
    )
    p.add_argument(
        "--sm",
        type=_int_in(*SM_RANGE, what="an SM number such as 90"),
        default=None,
        help=f"describe a CUDA GPU of this SM ({SM_RANGE[0]}..{SM_RANGE[1]}, e.g. 90 for "
        "H100/H200, "
        "100 for B200)",
    )
    p.add_argument(
        "--gpu",
        type=_gpu_name,
        default=None,
        help="describe a GPU by name, e.g. 'NVIDIA H200' (selects its shipped tuning table)",
    )
    p.set_defaults(fn=commands["explain"])

    p = command(
        "parity",
        "every available strategy against the fp32 oracle",
        "Spawn --world-size ranks on this machine, run every strategy that can run here on fresh "
        "random "
        "inputs (different per rank) and compare each output with the fp32 oracle. Lists the "
        "strategies "
        "it skipped, with their reason codes.",
    )
    _spec_args(p, 16, min_tokens=1, tokens_limit=PARITY_MAX_TOKENS)
    p.add_argument(
        "--world-size",
        type=_parity_world_size,
        default=1,
        help="ranks to spawn: with CUDA one per GPU (NCCL), at most the visible GPU count; on CPU "
        "gloo, "
        f"at most min({MAX_GLOO_RANKS}, CPU cores)",
    )
    p.add_argument(
        "--seed",
        type=_int_in(0, 2**63 - 1, "a seed (an integer)"),
        default=0,
        help="seed of the random inputs (0 .. 2**63-1)",
    )
    p.add_argument(
        "--weights", choices=["fp32", "bf16"], default="fp32", help="expert weight dtype"
    )
    p.set_defaults(fn=commands["parity"])

    p = command(
        "tune",
        "measure every strategy per token bucket and cache the plan (CUDA)",
        "Time every (strategy, launch variant) at each token bucket 1, 2, 4, ... up to "
        "--max-tokens on "
        "this machine's GPUs (one rank per GPU, NCCL), cache the table and print the plan.",
    )
    _spec_args(p, None)
    p.add_argument("--world-size", type=_int_in(1), default=1, help="ranks (one GPU each, NCCL)")
    p.set_defaults(fn=commands["tune"])

    p = command(
        "bench",
        "time every strategy and auto for T = 1, 2, 4, ... (CUDA); CSV + PNG",
        "Benchmark every strategy and auto for T = 1, 2, 4, ... up to --max-tokens, inputs rotated "
        "beyond "
        "L2 and replayed; write a long-format CSV and, with matplotlib, a PNG beside it.",
    )
    _spec_args(p, None, max_tokens_default=4096)
    p.add_argument("--world-size", type=_int_in(1), default=1, help="ranks (one GPU each, NCCL)")
    p.add_argument(
        "--csv", default="benchmarks/results/epilogue.csv", help="output CSV (PNG beside it)"
    )
    p.set_defaults(fn=commands["bench"])

    p = command(
        "matrix",
        "compatibility matrix generated from the registry (markdown)",
        "Evaluate every strategy's capability checks over described machines and print the "
        "compatibility matrix the README embeds.",
    )
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.set_defaults(fn=commands["matrix"])
    return parser


def check_combinations(parser: argparse.ArgumentParser, args) -> None:
    """Checks that involve two arguments, with the parser's one-line errors."""
    quant = getattr(args, "quant", None)
    if getattr(args, "sf_layout", None) is not None and quant != "nvfp4":
        parser.error(f"--sf-layout applies to --quant nvfp4 only, got --quant {quant}")
    if getattr(args, "quant_scale", None) is not None and quant not in ("fp8", "nvfp4"):
        parser.error(f"--quant-scale needs --quant fp8 or nvfp4, got --quant {quant}")
    for flag in ("group_size", "scale_layout"):
        if getattr(args, flag, None) is not None and quant != "fp8_per_token_group":
            parser.error(
                f"--{flag.replace('_', '-')} applies to --quant fp8_per_token_group only, got "
                f"--quant {quant}"
            )
    if getattr(args, "shared_output_replicated", False) and args.no_shared:
        parser.error("--shared-output-replicated contradicts --no-shared (no shared output)")
    if getattr(args, "gpu", None) is not None:
        known = sm_of_gpu(args.gpu)
        if args.sm is None and known is None:
            parser.error(
                f"--gpu {args.gpu!r} is not a GPU whose SM is known here "
                f"({', '.join(KNOWN_GPUS)}): give --sm too"
            )
        if args.sm is not None and known is not None and args.sm != known:
            parser.error(f"--sm {args.sm} contradicts --gpu {args.gpu!r} (SM {known})")
    raw = os.environ.get(STRATEGY_ENV)
    if raw:
        from fusion_bridge.strategies import REGISTRY

        if raw != "auto" and raw not in REGISTRY:
            parser.error(
                f"{STRATEGY_ENV}={raw!r} is not a strategy: use 'auto' or one of "
                f"{', '.join(REGISTRY)}"
            )
