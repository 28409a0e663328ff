"""End to end on one GPU: is a transformers MoE model patched with the bridge never slower than the
model's own (issue 47), family by family.

    python benchmarks/hf_end_to_end.py --json $OUT/hf.json --csv $OUT/hf.csv    # one GPU
    python benchmarks/hf_end_to_end.py --family deepseek_v3 qwen3_moe           # some families
    python benchmarks/hf_end_to_end.py --cpu-smoke                              # plumbing, CPU

Every family of the patch's table (benchmarks/hf_real_shapes.py; one this transformers lacks, or
the patch refuses here, is skipped with the reason) is built from transformers' own model code
with random weights drawn on the device (no download, no CPU init) at its real shape, with the
routed experts cut (hf_real_shapes.REAL) and as many decoder layers as fit --budget-gb of weights
(default 24), at most --max-layers (default 4). It times one forward of T tokens (no cache) for T
in --tokens (default 1 16 128 1024), for the unpatched model and patched with strategy="auto"
(and "separate", the adapter's expert path with the unfused epilogue, with --separate):

- eager: --rounds alternated rounds (default 5; each round patches each variant once, in a
  rotated order, and times --iters forwards per T, the round's value their median);
- under CUDA graphs: the unpatched forward is captured once per T, then per patched variant its
  forward; --rounds rounds alternate --iters replays of the two, so this mode has rounds too.

Each (family, T, mode) row is judged by benchmarks/hf_verdict.py: patched auto passes when its
median over rounds is at most the unpatched median x (1 + s), s the unpatched rounds' (max -
min) / median; printed in every row and kept in the CSV's extra. Per T it also prints where the
patched eager forward's time goes, per MoE layer (the adapter's routing + experts + shared
expert and the bridge's call, host and GPU time each; the rest of the forward), and at T=128 (or
the largest T below) the patched logits' worst error over the bound of
migration/examples/hf_moe_bound.py. The run ends with the table and a summary line (rows that
pass / miss, the misses). --csv (the harness schema, benchmarks/harness.py) and --json (the
verdicts, for tools: `python benchmarks/hf_verdict.py FILE` prints them again) are rewritten
after every family, so a run cut short keeps what it measured; no family is started after
--deadline-s (default 480; 0: none), nor after a failure that leaves CUDA unusable, and the
ones left are listed (any other failure is reported with its family and the run goes on).
--cpu-smoke: tiny models on CPU, T 1 and 16, two rounds of one forward, CUDA graphs stood in for
by eager forwards: checks the script, measures nothing. Nothing runs at import; `--help` works
without a GPU.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import traceback
from typing import Optional

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks import harness  # noqa: E402
from benchmarks.hf_real_shapes import REAL, build, size_for, why_skipped  # noqa: E402
from benchmarks.hf_timing import (  # noqa: E402
    Clock,
    eager_rounds,
    graph_rounds,
    short_error,
    sync,
    time_eager,
    variant,
)
from benchmarks.hf_verdict import Results, judge  # noqa: E402

VARIANTS = ("unpatched", "auto", "separate")
TOKENS = (1, 16, 128, 1024)
CHECK_T = 128  # the T whose logits are checked against the bound (or the largest T below it)


def breakdown(model, inputs: dict, iters: int) -> dict:
    """{T: where the patched (auto) eager forward's time goes, per MoE layer}: the adapter's
    expert share and the bridge's call (host us and, on CUDA, GPU us each), and the rest of the
    forward's wall time outside those two (per forward). Empty where the patched layers no
    longer have the two methods it clocks."""
    cuda = next(iter(inputs.values())).device.type == "cuda"
    out = {}
    with variant(model, "auto", max(inputs)) as patch, torch.no_grad():
        layers = list(patch.layers.values())
        if not all(hasattr(p, "expert_share") and hasattr(p, "_finalize") for p in layers):
            return {}
        experts, bridge = Clock(cuda), Clock(cuda)
        for layer in layers:
            layer.expert_share = experts.wrap(layer.expert_share)
            layer._finalize = bridge.wrap(layer._finalize)
        for tokens, ids in inputs.items():
            time_eager(model, ids, 1, warm=0)  # warm-up with the clocks on
            experts.take(), bridge.take()
            wall = 0.0
            for _ in range(iters):
                sync(ids.device)
                start = time.perf_counter()
                model(ids, use_cache=False)
                sync(ids.device)
                wall += (time.perf_counter() - start) * 1e6
            (eh, eg), (bh, bg) = experts.take(), bridge.take()
            n = iters * len(layers)
            per = dict(experts_host_us=eh / n, bridge_host_us=bh / n)
            if cuda:
                per.update(experts_gpu_us=eg / n, bridge_gpu_us=bg / n)
            per.update(rest_us=(wall - eh - bh) / iters, moe_layers=len(layers))
            out[tokens] = per
    return out


def agreement(model, ids: torch.Tensor, variants: tuple) -> dict:
    """Each patched variant's worst per-token logits error over the bound (hf_moe_bound.py) on the
    tokens whose routing agreed with the unpatched model's (tainted_positions), and how many
    tokens a routing flip took out of the comparison."""
    from migration.examples.hf_moe_bound import Recorder, tainted_positions

    recorder = Recorder(model)
    out = {}
    with torch.no_grad():
        recorder.start()
        ref = model(ids, use_cache=False).logits.float()
        ref_call = recorder.calls[0]
        bound = recorder.bound(ref_call, model, 1)[1].to(ref.device).view(ref.shape[:-1])
        for name in variants[1:]:
            with variant(model, name, ids.shape[1]):
                recorder.start()
                new = model(ids, use_cache=False).logits.float()
            tainted, _ = tainted_positions(
                [ref_call["routing"]], [recorder.calls[0]["routing"]], recorder, 1
            )
            clean = torch.tensor([p not in tainted[0] for p in range(ids.shape[1])])
            rel = ((new - ref).norm(dim=-1) / ref.norm(dim=-1) / bound)[0].cpu()
            worst = float(rel[clean].max()) if clean.any() else float("nan")
            out[name] = (worst, int((~clean).sum()))
    recorder.remove()
    return out


def _shape(model) -> tuple[str, int]:
    """('H=.. K=.. E=.. L=..', MoE layers) read from the built model."""
    from fusion_bridge.integrations.hf_families import family_of

    row, text = family_of(model)
    blocks = [b for b in (row.moe_block(layer) for layer in text.layers) if b is not None]
    experts = blocks[0].experts.gate_up_proj.shape[0]
    shape = f"H={text.config.hidden_size} K={row.top_k(blocks[0])} E={experts}"
    return f"{shape} L={len(text.layers)}", len(blocks)


def run_family(family: str, args, rows: harness.Rows, results: Results, log) -> None:
    """Build, time and judge one family; its rows and verdicts go to rows and results."""
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    why = why_skipped(family, device)
    if why is not None:
        results.skipped[family] = why
        log(f"{family}: skipped: {why}")
        return
    layers, gb = (3, 0.0) if args.cpu_smoke else size_for(family, args.budget_gb, args.max_layers)
    model = build(family, layers, device, args.cpu_smoke)
    shape, moe = _shape(model)
    results.shapes[family] = shape
    log(f"{family} {shape} ({moe} MoE layers): {gb:.1f} GB of weights built")
    gen = torch.Generator().manual_seed(1)
    # ids below 32000: clear of the special tokens at the top of every vocabulary (a wrapper's
    # image placeholder among them would ask for image features)
    high = min(model.get_input_embeddings().num_embeddings, 32000)
    inputs = {t: torch.randint(1, high, (1, t), generator=gen).to(device) for t in args.tokens}
    variants = VARIANTS if args.separate else VARIANTS[:2]
    eager = eager_rounds(model, inputs, variants, args, log)
    graph, notes = ({}, {}) if args.no_graphs else graph_rounds(model, inputs, variants, args, log)
    split, agree = {}, {}  # secondary to the verdicts: a failure is reported, the rows kept
    try:
        split = breakdown(model, inputs, args.iters)
        if not split:
            log(f"{family}: no breakdown: the patched layers lack expert_share / _finalize")
    except Exception as exc:  # noqa: BLE001 - reported
        results.errors[f"{family} breakdown"] = short_error(exc)
        log(f"{family}: breakdown FAILED: {short_error(exc)}")
    check = max([t for t in args.tokens if t <= CHECK_T] or [min(args.tokens)])
    try:
        agree = agreement(model, inputs[check], variants)
    except Exception as exc:  # noqa: BLE001 - reported
        results.errors[f"{family} logits check"] = short_error(exc)
        log(f"{family}: logits check FAILED: {short_error(exc)}")
    for tokens in args.tokens:
        verdicts = [
            judge(family, tokens, "eager", eager["unpatched"][tokens], eager["auto"][tokens])
        ]
        if graph:
            note = notes.get(("auto", tokens), "")
            verdicts.append(
                judge(
                    family, tokens, "graph", graph["unpatched"][tokens], graph["auto"][tokens], note
                )
            )
        results.verdicts.extend(verdicts)
        details = dict(split.get(tokens, {}))
        if tokens == check:
            details.update({f"logits_err_over_bound_{v}": e for v, (e, _) in agree.items()})
        results.details[(family, tokens)] = details
        _add_rows(rows, f"{family} {shape}", tokens, eager, graph, verdicts, details)
        log(f"{family} T={tokens}")
        _print(
            tokens, eager, graph, verdicts, split.get(tokens), agree if tokens == check else {}, moe
        )
    log(f"{family} done")
    del model


def _add_rows(rows, shape, tokens, eager, graph, verdicts, details) -> None:
    for mode, timed in (("eager", eager), ("graph", graph)):
        verdict = next((v for v in verdicts if v.mode == mode), None)
        for name, by_t in timed.items():
            rounds = by_t[tokens]
            if not rounds:
                continue
            extra = dict(mode=mode, rounds=len(rounds), spread_us=(min(rounds), max(rounds)))
            if name == "auto" and verdict is not None:
                extra.update(
                    s=verdict.spread, passes=verdict.passes, unpatched_us=verdict.unpatched_us
                )
                extra.update(details if mode == "eager" else {})
            rows.add(name, "fusion_bridge", shape, tokens, statistics.median(rounds), **extra)


def _print(tokens, eager, graph, verdicts, split, agree, moe) -> None:
    def medians(timed):
        spans = {v: ts[tokens] for v, ts in timed.items() if ts[tokens]}
        return ", ".join(
            f"{v} {statistics.median(t):.0f} ({min(t):.0f}..{max(t):.0f})" for v, t in spans.items()
        )

    print(f"  T={tokens:5d} eager us (median of rounds, min..max): {medians(eager)}")
    if graph and any(ts[tokens] for ts in graph.values()):
        print(f"          CUDA graph us: {medians(graph)}")
    for v in verdicts:
        print(f"          {v.line()}")
    if "separate" in eager and eager["separate"][tokens]:
        saves = statistics.median(eager["separate"][tokens]) - statistics.median(
            eager["auto"][tokens]
        )
        print(f"          per MoE layer, eager: the fused epilogue saves {saves / moe:.1f} us")
    if split:
        gpu = "experts_gpu_us" in split
        print(
            "          patched auto per MoE layer: adapter experts "
            f"{split['experts_host_us']:.0f} us host"
            + (f" / {split['experts_gpu_us']:.0f} us GPU" if gpu else "")
            + ", bridge "
            f"{split['bridge_host_us']:.0f} us host"
            + (f" / {split['bridge_gpu_us']:.0f} us GPU" if gpu else "")
            + f"; rest of the forward {split['rest_us']:.0f} us"
        )
    if agree:
        print(
            "          logits error / bound (<= 1 expected) on the tokens routed as unpatched: "
            + ", ".join(
                f"{v} {e:.2f} ({n} tokens after a routing flip)" for v, (e, n) in agree.items()
            )
        )
    sys.stdout.flush()


def cuda_unusable() -> Optional[str]:
    """Why the process's CUDA context can no longer run work (a sticky error, e.g. after a failed
    capture), or None."""
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device="cuda") + 1).item()
    except Exception as exc:  # noqa: BLE001 - what the run reports
        return short_error(exc)
    return None


def main(argv=None) -> int:
    ap = harness.add_common(harness.parser(__doc__), tokens=list(TOKENS))
    ap.add_argument("--family", nargs="+", choices=list(REAL), default=None)
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds (eager and graphs)")
    ap.add_argument("--iters", type=int, default=10, help="forwards (replays) per round")
    ap.add_argument("--budget-gb", type=float, default=24.0, help="weights budget per model")
    ap.add_argument("--max-layers", type=int, default=4, help="decoder layers at most")
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    ap.add_argument("--separate", action="store_true", help='also time strategy="separate"')
    ap.add_argument("--skip-separate", dest="separate", action="store_false", help="(default)")
    ap.add_argument("--json", default=None, help="write the verdicts there (hf_verdict.py)")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no family after")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU: plumbing only")
    args = ap.parse_args(argv)
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.cpu_smoke:
        args.tokens = [t for t in args.tokens if t <= 16] or [1, 16]
        args.rounds, args.iters = 2, 1
        torch.set_num_threads(1)  # tiny models: more threads only wait for each other
    elif not torch.cuda.is_available():
        print("hf_end_to_end: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    deadline = args.deadline_s if args.deadline_s is not None else (0 if args.cpu_smoke else 480)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    import transformers

    rows, results = harness.Rows(), Results()
    results.meta = dict(
        gpu=harness.gpu_name(), versions=harness.versions(), commit=harness.commit(),
        transformers=transformers.__version__, argv=list(sys.argv[1:] if argv is None else argv),
    )  # fmt: skip
    families = args.family or list(REAL)

    def save() -> None:  # after every family: a run cut short keeps what it measured
        if args.csv:
            with contextlib.redirect_stdout(None):  # its "wrote N rows" line
                rows.write(args.csv)
        if args.json:
            results.write_json(args.json)

    for i, family in enumerate(families):
        if deadline and time.perf_counter() - started > deadline:
            results.not_run = families[i:]
            log(f"deadline ({deadline:.0f} s) passed: not run: {' '.join(results.not_run)}")
            break
        try:
            run_family(family, args, rows, results, log)
        except Exception as exc:  # noqa: BLE001 - one family's failure is reported, the run goes on
            results.errors[family] = short_error(exc)
            log(f"{family}: FAILED: {short_error(exc)}\n{traceback.format_exc(limit=-4)}")
            broken = None if args.cpu_smoke else cuda_unusable()
            if broken is not None:  # every later family would fail the same way
                results.not_run = families[i + 1 :]
                results.stopped = f"CUDA unusable after {family}"
                log(f"CUDA unusable after {family}'s failure ({broken}): stopping")
                save()
                break
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
        left = len(families) - i - 1
        log(f"{i + 1} of {len(families)} families done" + (f", {left} left" if left else ""))
        save()
    save()
    print("\n" + "\n".join(results.table() + [""] + results.summary()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
