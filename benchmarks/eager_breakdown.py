"""Where an eager `finalize_epilogue` call's host time goes at world size 1 (`fused_tp1`): each
stage of the call timed on its own, by calling the real function the call runs for it, beside the
whole call (issue 50).

    python benchmarks/eager_breakdown.py                       # one GPU: every stage
    python benchmarks/eager_breakdown.py --device cpu          # no GPU: host stages, no launch
    python benchmarks/eager_breakdown.py --tokens 1 --quant nvfp4 --rounds 9

Per (quant, T), every stage runs `--calls` times per round in alternating rounds (`--rounds`), and
the median of the rounds' per-call times is reported (us; wall: each round ends with a device
synchronize). Stages, in the order a call runs them:

- one_caller: `one_caller.enter` + `leave` (one call at a time per process group);
- inputs_record: the call's `EpilogueInputs`;
- validation: the metadata check (`bridge._looks_valid`, `call/validation.py`'s `input_check`);
- out_check (the out= path only): the caller's preallocated outputs checked
  (`bridge._out_looks_valid`, `call/out_check.py`'s `output_check`, then `validate_out` where it
  refuses; a tree without it: `validate_out`);
- routing: the planned route for T (`bridge._route`: the eager or graph routes, by bucket);
- capture_query: whether the current stream is capturing (`bridge._capturing`, for the counter);
- check_error: the pinned error word of an earlier split launch (`FusedTp1Strategy.check_error`);
- output_allocation (the allocating call only): the call's outputs (the strategy's
  `OutputAllocator`: `allocate_outputs`'s outputs from templates kept per T);
- records: `RowSource` / `RowOutputs` of the call (`call_records` with the outputs given: the two
  records `FusedTp1Strategy.run` builds in place);
- plan_lookup: the launch decided for T (`Tp1Launcher.plan`);
- split_sync: the split rows' record of this stream's words (`Tp1Launcher.split_sync`);
- launch_key: the launch cache's key of the call (the plan's bound launch keys only the records);
- launch: the bare launch of the kernel the call runs, records built once, outputs preallocated
  (`Tp1Launcher.bound`; also eager_cost.py's `fused_tp1_kernel_cached`); it includes launch_key;
- strategy_run / strategy_run_out: the strategy's whole run (`FusedTp1Strategy.run`), allocating
  / into outputs preallocated once (`run(inputs, out=out)`);
- finalize_epilogue / finalize_epilogue_out: the whole call, allocating its outputs / with
  `out=` outputs the caller preallocated once (as a serving engine that owns its buffers calls
  it). `unattributed` is finalize_epilogue less the stages of its path (every stage above but
  out_check; launch_key is inside launch, so counted once), `unattributed_out` is
  finalize_epilogue_out less its path's (every stage but output_allocation): the Python frames
  between them.

With `--device cpu` the bridge is built with TRITON_INTERPRET=1 and no self-test, and the stages
that launch (launch, strategy_run*, finalize_epilogue*) are n/a; in their place the `*_no_launch`
rows time the same calls with the strategy's launcher replaced by a no-op (benchmark only: no
plan lookup, split_sync, launch key or launch in them), and `unattributed*_no_launch` is each
less its path's stages before the launcher (one_caller .. records, with output_allocation or
out_check). `--sms 132` plans the launches as on an H100 (split rows at small T: split_sync, and
the split kernel's key). Nothing runs at import.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Optional

H, K = 7168, 8
STAGES = (
    "one_caller",
    "inputs_record",
    "validation",
    "out_check",
    "routing",
    "capture_query",
    "check_error",
    "output_allocation",
    "records",
    "plan_lookup",
    "split_sync",
    "launch_key",
    "launch",
    "strategy_run",
    "strategy_run_out",
    "finalize_epilogue",
    "finalize_epilogue_out",
)
# the stages each whole call is made of (launch holds launch_key): the allocating call's and the
# out= call's; on CPU the no-launch calls hold those before the launcher
BEFORE_LAUNCHER = ("one_caller", "inputs_record", "validation", "routing", "capture_query",
                   "check_error", "records")  # fmt: skip
LAUNCHER = ("plan_lookup", "split_sync", "launch")
PATHS = {  # the whole call: (its stages, its unattributed row)
    "finalize_epilogue": (BEFORE_LAUNCHER + ("output_allocation",) + LAUNCHER, "unattributed"),
    "finalize_epilogue_out": (BEFORE_LAUNCHER + ("out_check",) + LAUNCHER, "unattributed_out"),
    "finalize_epilogue_no_launch": (
        BEFORE_LAUNCHER + ("output_allocation",), "unattributed_no_launch"),
    "finalize_epilogue_out_no_launch": (
        BEFORE_LAUNCHER + ("out_check",), "unattributed_out_no_launch"),
}  # fmt: skip
NO_LAUNCH = ("strategy_run_no_launch", "strategy_run_out_no_launch",
             "finalize_epilogue_no_launch", "finalize_epilogue_out_no_launch")  # fmt: skip
TP1_TARGET = 2.0  # issue 50: an eager call within 2x its kernel's bare cached launch


def tp1_anchor(bridge, inp, tokens: int, eager_kw: dict) -> dict[str, Callable[[], object]]:
    """{"fused_tp1_kernel_cached": the bare launch of the kernel the eager call runs} where that
    call's route is fused_tp1 (else {}): its launcher's bound launch for T, with the launcher's
    own config, records built once, outputs preallocated."""
    route = bridge.route_for(tokens, **eager_kw)
    if route is None or route[0] != "fused_tp1":
        return {}
    from fusion_bridge.epilogue_tensors import allocate_outputs

    strategy = bridge._instances["fused_tp1"]  # benchmark only: the bridge's prepared strategy
    _, src, dst = strategy.call_records(inp, allocate_outputs(bridge.spec, tokens, bridge.device))
    return {"fused_tp1_kernel_cached": strategy._launcher.bound(src, dst)}


def target_check(ratio_lines: list[dict]) -> list[str]:
    """Issue 50's eager target, one line per (quant, T) at world size 1 (`ratio_lines`:
    eager_cost.ratios): finalize_epilogue within TP1_TARGET x fused_tp1_kernel_cached of the same
    run, pass or miss; and, where the run has it, the same for finalize_epilogue_out (the call
    with `out=` outputs the caller preallocated, as the anchor's are)."""
    lines = []
    for line in ratio_lines:
        ratio = line.get("eager_vs_tp1_kernel")
        if line["world_size"] != 1 or ratio is None:
            continue
        text = (
            f"target TP1 {line['quant']} T={line['tokens']}: finalize_epilogue / "
            f"fused_tp1_kernel_cached = {ratio:.2f} (<= {TP1_TARGET:g}): {_verdict(ratio)}"
        )
        out_ratio = line.get("eager_out_vs_tp1_kernel")
        if out_ratio is not None:
            text += (
                f"; finalize_epilogue_out (out=) / fused_tp1_kernel_cached = {out_ratio:.2f}: "
                f"{_verdict(out_ratio)}"
            )
        lines.append(text)
    return lines


def _verdict(ratio: float) -> str:
    return "pass" if ratio <= TP1_TARGET else "miss"


class _NoLaunch:
    """A CPU breakdown's stand-in for the strategy's launcher in the `*_no_launch` calls (benchmark
    only): the real launcher's error word, no launch."""

    def __init__(self, real):
        self._error_word, self.take_error = real._error_word, real.take_error

    def __call__(self, src, out, config=None) -> None:
        return None


def _time(fns: dict[str, Callable[[], object]], calls: int, rounds: int, sync) -> dict:
    for fn in fns.values():  # warm: compiles, caches, plans
        for _ in range(20):
            fn()
    sync()
    got: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            got[name].append((time.perf_counter() - start) / calls * 1e6)
    return {n: statistics.median(v) for n, v in got.items()}


def stage_fns(bridge, inputs, tokens: int, launches: bool) -> dict[str, Callable[[], object]]:
    """{stage: a function running that stage of `bridge`'s eager call on `inputs` once}."""
    from fusion_bridge.call import one_caller, out_check
    from fusion_bridge.epilogue_tensors import EpilogueInputs, allocate_outputs
    from fusion_bridge.kernels import launch_cache

    spec, device = bridge.spec, bridge.device
    strategy, _ = bridge._route(inputs, tokens)
    if strategy.name != "fused_tp1":
        raise SystemExit(f"eager_breakdown: the route for T={tokens} is {strategy.name}")
    launcher = strategy._launcher
    out = allocate_outputs(spec, tokens, device)
    _, src, dst = strategy.call_records(inputs, out)
    plan, args = launcher.call_args(src, dst)
    has_shared, is_cuda, sf_dims = src.shared is not None, device.type == "cuda", dst.sf.shape
    bound = getattr(plan, "launch", None)
    lead = args[: 3 if plan.chunks else 2]
    key_args = lead if bound is not None else args  # main's tree keys every argument
    kinds = launch_cache._kinds(key_args)
    try:  # the bound launch's key also returns the records' addresses
        key_fn = launch_cache._make_key_fn(kinds, addresses=bound is not None)
    except TypeError:  # a tree whose key function has no addresses
        key_fn = launch_cache._make_key_fn(kinds)
    warps, constexprs = (None, None) if bound is not None else (plan.warps, plan.constexprs)
    # the call's own allocation: the strategy's OutputAllocator (main's tree: the function)
    allocator = getattr(strategy, "_allocate", None)
    allocation = (
        (lambda: allocator(tokens))
        if allocator
        else (lambda: allocate_outputs(spec, tokens, device))
    )
    # the out= path: outputs the caller preallocated once, checked as the call checks them
    # (`validate_out` when the fast check refuses; a tree without it: `validate_out` alone)
    out_buf = allocate_outputs(spec, tokens, device)
    fast_out = getattr(bridge, "_out_looks_valid", None)
    if fast_out is not None and not fast_out(inputs, out_buf, tokens):
        raise SystemExit("eager_breakdown: the out= fast check refuses allocate_outputs' outputs")

    def check_out():
        if fast_out is None or not fast_out(inputs, out_buf, tokens):
            out_check.validate_out(spec, inputs, out_buf, tokens, device)

    fns: dict[str, Callable[[], object]] = {
        "one_caller": lambda: (one_caller.enter(bridge), one_caller.leave(bridge)),
        "inputs_record": lambda: EpilogueInputs(*inputs),
        "validation": lambda: bridge._looks_valid(inputs),
        "out_check": check_out,
        "routing": lambda: bridge._route(inputs, tokens),
        "capture_query": bridge._capturing,
        "check_error": strategy.check_error,
        "output_allocation": allocation,
        "records": lambda: strategy.call_records(inputs, out),
        "plan_lookup": lambda: launcher.plan(tokens, K, has_shared, is_cuda, sf_dims),
        "launch_key": lambda: key_fn(0, False, ("",), warps, constexprs, *key_args),
    }
    if plan.chunks and hasattr(launcher, "split_sync"):
        fns["split_sync"] = launcher.split_sync
    calls = {
        "strategy_run": lambda: strategy.run(inputs),
        "strategy_run_out": lambda: strategy.run(inputs, out=out_buf),
        "finalize_epilogue": lambda: bridge.finalize_epilogue(*inputs),
        "finalize_epilogue_out": lambda: bridge.finalize_epilogue(*inputs, out=out_buf),
    }
    if launches:
        fns["launch"] = launcher.bound(src, dst)
        fns.update(calls)
    else:  # timed with the strategy's launcher a no-op (`breakdown` installs `_NoLaunch`)
        fns.update((f"{name}_no_launch", call) for name, call in calls.items())
    return fns


def breakdown(quants: list[str], token_counts: list[int], calls: int, rounds: int,
              device_type: str, sms: int = 0) -> list[dict]:  # fmt: skip
    """Rows {quant, tokens, stage, us} for every stage, plus `unattributed`."""
    import torch

    from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    cuda = device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for quant in quants:
        spec = EpilogueSpec(
            hidden_size=H,
            top_k=K,
            quant=QuantSpec.nvfp4(336.0) if quant == "nvfp4" else QuantSpec.none(),
        )
        kwargs = {} if cuda else {"strategy": "fused_tp1", "self_test": False}
        with FusionBridge(spec, None, debug=False, **kwargs) as bridge:
            bridge._check_values = False  # as on a GPU without debug mode (CPU: benchmark only)
            if sms and not cuda:  # plan as on a GPU of that many SMs (host stages only)
                launcher = bridge._instances["fused_tp1"]._launcher
                launcher.num_sms = sms
                launcher._plans.clear()
            for tokens in token_counts:
                inputs = make_inputs(spec, tokens, device=bridge.device)
                fns = stage_fns(bridge, inputs, tokens, cuda)
                strategy = bridge._instances["fused_tp1"]
                real = strategy._launcher
                if not cuda:  # the *_no_launch calls: every stage above took the real one
                    strategy._launcher = _NoLaunch(real)
                try:
                    timed = _time(fns, calls, rounds, sync)
                finally:
                    strategy._launcher = real
                for stage in STAGES + (() if cuda else NO_LAUNCH):
                    rows.append(
                        {"quant": quant, "tokens": tokens, "stage": stage, "us": timed.get(stage)}
                    )
                for whole, (stages, name) in PATHS.items():
                    if whole in timed:
                        summed = sum(timed[k] for k in stages if k in timed)
                        rows.append({"quant": quant, "tokens": tokens, "stage": name,
                                     "us": timed[whole] - summed})  # fmt: skip
    return rows


def print_rows(rows: list[dict]) -> None:
    configs = sorted({(r["quant"], r["tokens"]) for r in rows})
    value = {(r["quant"], r["tokens"], r["stage"]): r["us"] for r in rows}
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    head = ["stage (us per call)"] + [f"{q} T={t}" for q, t in configs]
    first = max(len(x) for x in [head[0], *stages])
    print("  ".join(h.ljust(first if i == 0 else 20) for i, h in enumerate(head)))
    for stage in stages:
        cells = [stage] + [
            "n/a" if value.get((q, t, stage)) is None else f"{value[(q, t, stage)]:.2f}"
            for q, t in configs
        ]
        print("  ".join(c.ljust(first if i == 0 else 20) for i, c in enumerate(cells)))


def main(argv: Optional[list[str]] = None) -> int:
    from benchmarks.harness import add_common, parser

    ap = parser(__doc__)
    add_common(ap, tokens=[1, 64], quant=["none", "nvfp4"], quant_choices=["none", "nvfp4"],
               csv=False)  # fmt: skip
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any")
    ap.add_argument("--sms", type=int, default=0, help="--device cpu: plan for this many SMs")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    device = args.device
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print(
                "eager_breakdown: no GPU; run with --device cpu for the host stages",
                file=sys.stderr,
            )
            return 2
    print_rows(breakdown(args.quant, args.tokens, args.calls, args.rounds, device, args.sms))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
