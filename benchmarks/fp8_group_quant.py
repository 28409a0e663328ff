"""Issue 49's speed check on ONE GPU: the dynamic FP8 outputs (per-token-group FP8 in its three
scale layouts, dynamic per-token FP8) fused into `fused_tp1`, against the same call unquantized
and against the engines' way (the unquantized call, then a separate quantization kernel: ours,
kernels/fp8_group_quant.py), with the standalone kernel's bandwidth against a copy's.

    python benchmarks/fp8_group_quant.py [--quick] [--hidden 2048 2880 4096 5120 7168]
        [--tokens 1 16 64 256 1024 4096] [--formats group_row group_col group_tma token]
        [--group-size 128] [--top-k 8] [--csv P] [--json P] [--jobs 8] [--budget-min 25]

Expected runtime on one H100 or H200 (an estimate, not yet measured): about 10 minutes for the
full sweep (a few of them compiling, in --jobs processes), about 3 with --quick (H 4096 and 7168,
T 1, 256 and 4096, group_row and token). --budget-min bounds the timing part: points not started
by then are reported as skipped, with what was measured so far written out.

What is timed (CUDA graphs of many calls, inputs rotated past L2, median us per call:
fusion_bridge.tuning.timing.time_graph), per hidden size H and T:
- fused: `fused_tp1`'s call (the strategy's run, its default launch) unquantized ("none") and with
  each format;
- standalone: the standalone kernel on bf16 [T, H] inputs (inputs and outputs rotated), and its
  bandwidth: (2 + 1) bytes per element read and written plus 4 per scale (the TMA layout's padding
  included), over its time;
- pair: the engines' way, in one graph: the unquantized call, then the standalone kernel on that
  call's norm_out;
- copy: the device's copy bandwidth in the same run (bytes read plus written, 1 GiB).

Targets (a table with pass / miss per point; all in --json):
- quant_cost: fused(format) <= max(1.10 x fused(none), fused(none) + 0.5 us), every T;
- bandwidth: standalone bandwidth >= 0.80 x copy bandwidth, at T >= 1024;
- vs_pair: fused(format) <= pair(format) - 0.8 x standalone(format), every T.

A hidden size that is not a multiple of the group size (2880 of 128) is skipped for the group
formats, with the reason (per token takes any H). A point that fails (a format the strategy does
not support, an error, no memory) is reported with its reason and the run goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402

HIDDEN_SIZES = (2048, 2880, 4096, 5120, 7168)
TOKENS = (1, 16, 64, 256, 1024, 4096)
# format label -> (QuantSpec factory name, scale layout or None)
FORMATS = {
    "group_row": ("fp8_per_token_group", "row_major"),
    "group_col": ("fp8_per_token_group", "column_major"),
    "group_tma": ("fp8_per_token_group", "column_major_tma"),
    "token": ("fp8_per_token", None),
}
QUICK = dict(hidden=[4096, 7168], tokens=[1, 256, 4096], formats=["group_row", "token"])
QUANT_COST = (1.10, 0.5)  # fused(format) <= max(1.10 x none, none + 0.5 us)
BANDWIDTH_SHARE, BANDWIDTH_FROM_T = 0.80, 1024
PAIR_SHARE = 0.8  # fused <= pair - 0.8 x standalone


def admits(hidden: int, fmt: str, group_size: int) -> str | None:
    """Why `fmt` cannot run at this H (None: it can)."""
    if fmt != "none" and FORMATS[fmt][0] == "fp8_per_token_group" and hidden % group_size:
        return (
            f"H={hidden} is not a multiple of the group size {group_size} "
            f"({hidden} % {group_size} = {hidden % group_size}): the format has no such layout"
        )
    return None


def standalone_bytes(tokens: int, hidden: int, fmt: str, group_size: int) -> int:
    """Bytes the standalone kernel reads and writes: bf16 in, e4m3 out, fp32 scales (the TMA
    layout's storage of round_up(T, 4) rows)."""
    kind, layout = FORMATS[fmt]
    groups = hidden // group_size if kind == "fp8_per_token_group" else 1
    rows = -(-tokens // 4) * 4 if layout == "column_major_tma" else tokens
    return 3 * tokens * hidden + 4 * rows * groups


def check_targets(points: dict, copy_gbs: float) -> list[dict]:
    """The targets over measured `points` {(kind, fmt, H, T): value}, kind "fused" (us; fmt "none"
    too), "standalone" (us), "standalone_gbs" (GB/s), "pair" (us). A check needs every value it
    reads; one dict per checked point: target, format, H, T, value, bound, ok. Pure."""
    out = []

    def add(target, fmt, hidden, tokens, value, bound, ok):
        out.append(
            dict(
                target=target,
                format=fmt,
                H=hidden,
                T=tokens,
                value=round(value, 3),
                bound=round(bound, 3),
                ok=bool(ok),
            )
        )

    for (kind, fmt, hidden, tokens), value in sorted(points.items()):
        if kind == "fused" and fmt != "none":
            base = points.get(("fused", "none", hidden, tokens))
            if base is not None:
                bound = max(QUANT_COST[0] * base, base + QUANT_COST[1])
                add("quant_cost", fmt, hidden, tokens, value, bound, value <= bound)
            pair = points.get(("pair", fmt, hidden, tokens))
            alone = points.get(("standalone", fmt, hidden, tokens))
            if pair is not None and alone is not None:
                bound = pair - PAIR_SHARE * alone
                add("vs_pair", fmt, hidden, tokens, value, bound, value <= bound)
        if kind == "standalone_gbs" and tokens >= BANDWIDTH_FROM_T:
            bound = BANDWIDTH_SHARE * copy_gbs
            add("bandwidth", fmt, hidden, tokens, value, bound, value >= bound)
    return out


def _spec(hidden: int, top_k: int, fmt: str, group_size: int, max_tokens: int):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec

    if fmt == "none":
        quant = QuantSpec.none()
    elif FORMATS[fmt][0] == "fp8_per_token":
        quant = QuantSpec.fp8_per_token()
    else:
        quant = QuantSpec.fp8_per_token_group(group_size, FORMATS[fmt][1])
    return EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        quant=quant,
        max_tokens=max_tokens,
    )


def _strategy(spec):
    """fused_tp1 for `spec` on cuda:0, prepared; ValueError with the reasons where it does not
    support the spec."""
    import torch

    from fusion_bridge.environment import detect
    from fusion_bridge.registry import strategy_class

    dev = torch.device("cuda", 0)
    env = detect(device=dev, probe_flashinfer=False)
    cls = strategy_class("fused_tp1")
    reasons = cls.not_supported_reasons(spec, env)
    if reasons:
        raise ValueError("fused_tp1 does not run it: " + "; ".join(r.message for r in reasons))
    strat = cls(spec, env, None, dev)
    strat.prepare()
    return strat


def _standalone(fmt: str, group_size: int):
    """(allocate(T, H, device) -> (q, scales), launch(x, q, scales)) of the standalone kernel."""
    import torch

    from fusion_bridge.kernels.fp8_group_quant import empty_scales, fp8_group_quant_into

    kind, layout = FORMATS[fmt]
    per_token = kind == "fp8_per_token"

    def allocate(tokens, hidden, device):
        q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
        groups = 1 if per_token else hidden // group_size
        return q, empty_scales(tokens, groups, layout or "row_major", device)

    def launch(x, q, scales):
        size = x.shape[1] if per_token else group_size
        fp8_group_quant_into(q, scales, x, size, layout or "row_major")

    return allocate, launch


def _warm(task) -> str:
    """Compile fused_tp1 for one (H, format) and the standalone kernel at every T (a worker)."""
    hidden, top_k, fmt, group_size, tokens_list = task
    try:
        import torch

        from fusion_bridge.oracle.synthetic import make_inputs

        spec = _spec(hidden, top_k, fmt, group_size, max(tokens_list))
        strat = _strategy(spec)
        for tokens in tokens_list:
            out = strat.run(make_inputs(spec, tokens, seed=0, device="cuda"))
            if fmt != "none":
                allocate, launch = _standalone(fmt, group_size)
                launch(out.norm_out, *allocate(tokens, hidden, out.norm_out.device))
        torch.cuda.synchronize()
        return f"compiled {fmt} H={hidden}"
    except Exception as exc:  # reported again, per point, when timed
        return f"not compiled {fmt} H={hidden}: {type(exc).__name__}: {exc}"


def _print_table(checks: list[dict], problems: list[dict]) -> None:
    print(f"\n{'target':11s} {'format':10s} {'H':>5s} {'T':>5s} {'value':>10s} {'bound':>10s}")
    for c in checks:
        unit = "GB/s" if c["target"] == "bandwidth" else "us"
        print(
            f"{c['target']:11s} {c['format']:10s} {c['H']:5d} {c['T']:5d} {c['value']:10.2f} "
            f"{c['bound']:10.2f} {unit:4s} {'pass' if c['ok'] else 'MISS'}"
        )
    for target in ("quant_cost", "bandwidth", "vs_pair"):
        mine = [c for c in checks if c["target"] == target]
        met = sum(c["ok"] for c in mine)
        print(f"{target}: {met} of {len(mine)} points met", flush=True)
    for p in problems:
        print(f"not measured: {p['what']} H={p['H']} T={p['T']}: {p['reason']}", flush=True)


class Sweep:
    """The timed part of a run: every point in `points` (check_targets' keys), the CSV rows in
    `rows`, every point not measured in `problems` (what, H, T, reason)."""

    def __init__(self, args, copy_gbs: float):
        from fusion_bridge.tuning.timing import sets_to_rotate, time_graph

        self.args, self.copy_gbs = args, copy_gbs
        self.rotate, self.time_graph = sets_to_rotate, time_graph
        self.rows, self.points, self.problems = Rows(), {}, []
        self.deadline = time.monotonic() + 60 * args.budget_min
        self.rows.add("hbm_copy", "hardware", "1 GiB", 0, None, gbs=round(copy_gbs, 1))

    def problem(self, what: str, hidden: int, tokens: int, reason: str) -> None:
        reason = reason.splitlines()[0][:300] if reason else "?"
        self.problems.append(dict(what=what, H=hidden, T=tokens, reason=reason))
        print(f"not measured: {what} H={hidden} T={tokens}: {reason}", flush=True)

    def time(self, what: str, fmt: str, hidden: int, tokens: int, fn, sets: int):
        """Median us per call of fn(i) over `sets` rotated sets, recorded; None (a problem row,
        the run goes on) where it raises or the budget is spent."""
        if time.monotonic() > self.deadline:
            self.problem(f"{what} {fmt}", hidden, tokens, "--budget-min reached")
            return None
        try:
            us = self.time_graph(fn, sets=sets)
        except Exception as exc:
            self.problem(f"{what} {fmt}", hidden, tokens, f"{type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            return None
        self.points[(what, fmt, hidden, tokens)] = us
        return us

    def strategies(self, hidden: int, formats: list) -> dict:
        """fused_tp1 per format that runs at this H (the others: problem rows)."""
        args, strats = self.args, {}
        for fmt in formats:
            reason = admits(hidden, fmt, args.group_size)
            if reason is None:
                try:
                    spec = _spec(hidden, args.top_k, fmt, args.group_size, max(args.tokens))
                    strats[fmt] = _strategy(spec)
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
            if reason is not None:
                self.problem(f"every point of {fmt}", hidden, 0, reason)
        return strats

    def point(self, hidden: int, tokens: int, strats: dict, quantized: list) -> None:
        """Every measurement at (H, T): fused per format fused_tp1 runs (`strats`), standalone and
        pair per quantized format the H admits (whether or not fused_tp1 runs it)."""
        import torch

        from fusion_bridge.oracle.synthetic import make_inputs

        args = self.args
        shape = f"H={hidden} K={args.top_k}"
        spec = _spec(hidden, args.top_k, "none", args.group_size, max(args.tokens))
        n = self.rotate(tokens * hidden * 2 * (args.top_k + 5), max_sets=64)
        sets = [
            make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0) for i in range(n)
        ]
        for fmt, strat in strats.items():
            us = self.time("fused", fmt, hidden, tokens, lambda i, s=strat: s.run(sets[i]), n)
            if us is not None:
                self.rows.add("fused_tp1", "fusion_bridge", f"{shape} {fmt}", tokens, us)
                print(f"fused_tp1  {fmt:10s} H={hidden:5d} T={tokens:5d} {us:8.2f} us", flush=True)
        base = strats["none"]
        for fmt in quantized:
            allocate, launch = _standalone(fmt, args.group_size)
            m = self.rotate(tokens * hidden * 3, max_sets=64)
            xs = [torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(m)]
            outs = [allocate(tokens, hidden, "cuda") for _ in range(m)]
            us = self.time("standalone", fmt, hidden, tokens, lambda i: launch(xs[i], *outs[i]), m)
            if us is not None:
                gbs = standalone_bytes(tokens, hidden, fmt, args.group_size) / (us * 1e3)
                share = gbs / self.copy_gbs
                self.points[("standalone_gbs", fmt, hidden, tokens)] = gbs
                self.rows.add(
                    "fp8_group_quant", "fusion_bridge", f"{shape} {fmt}", tokens, us,
                    gbs=round(gbs, 1), x_copy=round(share, 3),
                )  # fmt: skip
                print(
                    f"standalone {fmt:10s} H={hidden:5d} T={tokens:5d} {us:8.2f} us "
                    f"{gbs:7.0f} GB/s ({share:5.1%} of copy)",
                    flush=True,
                )
            pair_outs = [allocate(tokens, hidden, "cuda") for _ in range(n)]

            def pair(i):
                launch(base.run(sets[i]).norm_out, *pair_outs[i])

            us = self.time("pair", fmt, hidden, tokens, pair, n)
            if us is not None:
                note = "fused_tp1 unquantized, then the standalone kernel on its norm_out"
                self.rows.add(
                    "engines_way", "fusion_bridge", f"{shape} {fmt}", tokens, us, note=note
                )
                print(f"pair       {fmt:10s} H={hidden:5d} T={tokens:5d} {us:8.2f} us", flush=True)


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap,
        tokens=TOKENS,
        hidden=HIDDEN_SIZES,
        top_k=8,
        csv_default="benchmarks/results/fp8_group_quant.csv",
    )
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--group-size", type=int, default=128, help="per-token-group size")
    ap.add_argument("--quick", action="store_true", help=f"fewer points: {QUICK}")
    ap.add_argument("--json", default="benchmarks/results/fp8_group_quant.json", help="checks")
    ap.add_argument("--jobs", type=int, default=8, help="compile processes")
    ap.add_argument("--budget-min", type=float, default=25.0, help="timing budget, minutes")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.tokens, args.formats = QUICK["hidden"], QUICK["tokens"], QUICK["formats"]
    import torch

    if not torch.cuda.is_available():
        sys.exit("fp8_group_quant.py needs a CUDA GPU (one is enough)")
    from fusion_bridge.tuning.timing import copy_bandwidth_gbs

    formats = ["none"] + list(args.formats)
    tasks = [
        (h, args.top_k, f, args.group_size, list(args.tokens))
        for h in args.hidden
        for f in formats
        if admits(h, f, args.group_size) is None
    ]
    try:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            for i, done in enumerate(pool.map(_warm, tasks), 1):
                print(f"{i}/{len(tasks)}: {done}", flush=True)
    except Exception as exc:  # a broken pool: the kernels compile at their first timing instead
        print(f"compile processes failed ({type(exc).__name__}: {exc}); going on", flush=True)
    copy_gbs = copy_bandwidth_gbs(1 << 30)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    sweep = Sweep(args, copy_gbs)
    for hidden in args.hidden:
        strats = sweep.strategies(hidden, formats)
        quantized = [f for f in args.formats if admits(hidden, f, args.group_size) is None]
        if "none" in strats:
            for tokens in args.tokens:
                try:
                    sweep.point(hidden, tokens, strats, quantized)
                except Exception as exc:  # inputs or buffers: the rest of this point is lost
                    sweep.problem("the rest of the point", hidden, tokens, repr(exc))
                    traceback.print_exc(limit=3)
        strats = None
        torch.cuda.empty_cache()
    checks = check_targets(sweep.points, copy_gbs)
    _print_table(checks, sweep.problems)
    if args.csv:
        sweep.rows.write(args.csv)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            report = dict(copy_gbs=round(copy_gbs, 1), checks=checks, not_measured=sweep.problems)
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
