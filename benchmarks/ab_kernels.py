"""Same-run A/B of our kernels between two trees: run it once per tree in the same device call, from
that tree's root (PYTHONPATH selects the tree; it adapts to the launch API before and after the
kernel restructure). H=7168, K=8; T from AB_TOKENS (1,64,1024,4096); quant modes from AB_QUANTS
(none; also fp8, nvfp4: the local path, tp1 and W=2 cases); the two-launch local path (AB_LOCAL=0:
not) and the kernels from AB_CASES (kind:world: tp1:1 is `fused_tp1`'s launch as its strategy
makes it; oneshot / twoshot the symmetric-memory kernels, W ranks emulated on one GPU, one CUDA
graph per rank; a tree without kernels/symm_twoshot.py, which the ring replaced, skips the twoshot
cases, one without kernels/tp1/ the tp1 ones); graph and eager; inputs rotated past L2. JSON rows
on stdout and in $OUT/ab_<label>.jsonl.

    cd <tree> && PYTHONPATH=$PWD OUT=... python <this file> <label> [reps]

(`TREE=<tree> bash benchmarks/device.sh ab_kernels <label>` does the same.) Standard library and
the tree's package only: it runs against trees older than benchmarks/harness.py.
"""

import argparse
import importlib
import inspect
import json
import os
import statistics
import sys

import torch

from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
from fusion_bridge.kernels import ops


def _first(*names: str):
    """The first of the modules `names` the tree has. Older trees' names come first: an editable
    install of another checkout can supply a newer name that the tree itself lacks."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names}")


_timing = _first("fusion_bridge.timing", "fusion_bridge.tuning.timing")
sets_to_rotate, time_eager, time_graph = (
    _timing.sets_to_rotate,
    _timing.time_eager,
    _timing.time_graph,
)
make_inputs = _first("fusion_bridge.synthetic", "fusion_bridge.oracle.synthetic").make_inputs
symm_oneshot = _first("fusion_bridge.kernels.symm_oneshot", "fusion_bridge.kernels.symm.oneshot")

try:  # the persistent two-shot kernel: trees before the ring replaced it
    from fusion_bridge.kernels import symm_twoshot
except ImportError:
    symm_twoshot = None

label = ""  # the tree's name in the rows (main)
CASES = [
    tuple(c.split(":"))
    for c in os.environ.get("AB_CASES", "oneshot:2,twoshot:1,twoshot:2").split(",")
]
CASES = [(k, int(w)) for k, w in CASES]
TOKENS = [int(t) for t in os.environ.get("AB_TOKENS", "1,64,1024,4096").split(",")]
LOCAL = os.environ.get("AB_LOCAL", "1") == "1"
QUANTS = os.environ.get("AB_QUANTS", "none").split(",")  # none, fp8, nvfp4
H, K = 7168, 8
# the launch API after the kernel restructure: a module function `launch`, or (issue 46) a launcher
# class per kernel family called with the records
NEW = hasattr(symm_oneshot, "launch") or hasattr(symm_oneshot, "OneshotLauncher")
try:
    fast = ops.direct_when_eager
except AttributeError:  # trees before it
    fast = ops.fast
rows = []


def emit(path, T, world, mode, us):
    row = dict(tree=label, path=path, T=T, W=world, mode=mode, us=round(us, 3))
    rows.append(row)
    print(json.dumps(row), flush=True)


def quant_tuple(spec):
    q = spec.quant
    code = {"none": 0, "fp8": 1, "nvfp4": 2}[q.kind.value]
    scale = q.scale if code == 1 else (q.global_scale if code == 2 else 1.0)
    return code, float(scale), q.sf_layout is SFLayout.SWIZZLED_128x4


def outs_for(spec, T):
    try:
        from fusion_bridge.epilogue_tensors import quant_buffers
    except ImportError:  # before the rename
        from fusion_bridge.io import quant_buffers

    ro = torch.empty(T, H, dtype=spec.dtype, device="cuda")
    no = torch.empty_like(ro)
    q, sf = quant_buffers(T, H, spec.quant.kind, spec.quant.sf_layout, ro.device)
    e = torch.empty(0, dtype=torch.uint8, device="cuda")
    q = e if q is None else q.view(torch.uint8)
    sf = e if sf is None else sf
    return ro, no, q, sf


def _family_call(launcher, rig):
    """fn(inputs, outs) calling a kernel family's launcher as the tree takes its arguments: the
    records (issue 46: `call_records`) or the tensors by keyword (before)."""
    if hasattr(rig, "call_records"):
        return lambda inp, out: launcher(*rig.call_records(inp, out))
    return lambda inp, out: launcher(**rig.call_tensors(inp, out))


def tp1_group(spec):
    """`fused_tp1`'s launch as the strategy makes it (its launcher over this GPU's SMs): one
    closure fn(inputs, outs); None where the tree has no kernels/tp1/."""
    from fusion_bridge.kernels.layer import LayerRecord

    launcher_module = _first_or_none(
        "fusion_bridge.kernels.tp1.launch", "fusion_bridge.kernels.tp1.launcher"
    )
    if launcher_module is None:
        return None
    cls = getattr(launcher_module, "Tp1Launcher", None) or launcher_module.Tp1Dispatcher
    rig = _first("fusion_bridge.kernels.symm_testing", "fusion_bridge.testing.symm_oneshot_rig")
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launcher = cls(LayerRecord.of(spec), sms, device)
    return [_family_call(launcher, rig)], launcher


def _first_or_none(*names: str):
    try:
        return _first(*names)
    except ModuleNotFoundError:
        return None


def kernel_group(kind, spec, world, cap):
    """Per-rank launch closures fn(rank, inputs, outs)."""
    if kind == "tp1":
        return tp1_group(spec)
    kern = {"oneshot": symm_oneshot, "twoshot": symm_twoshot}[kind]
    if NEW:
        rig = _first("fusion_bridge.kernels.symm_testing", "fusion_bridge.testing.symm_oneshot_rig")
        emulated_group = rig.emulated_group
        # the one-shot's rig took the kernel kind first until the two-shot got its own
        lead = (kind,) if "kind" in inspect.signature(emulated_group).parameters else ()
        g = emulated_group(*lead, spec, world, cap, device="cuda", timeout=10_000_000)
        cls = getattr(kern, "OneshotLauncher", None) or getattr(kern, "TwoshotLauncher", None)
        if cls is not None:  # issue 46: one launcher per family, called with the records
            return [_family_call(cls(layer), rig) for layer in g.layers], g
        return [
            (lambda inp, out, layer=layer: kern.launch(layer, **rig.call_tensors(inp, out)))
            for layer in g.layers
        ], g
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from test_gpu_symm_one_device import _workspaces

    wss, bufs = _workspaces(kern, world, cap, H)
    quant, scale, swz = quant_tuple(spec)

    def mk(ws):
        def fn(inp, out):
            ro, no, q, sf = out
            kern.fused_into(
                ws,
                ro,
                no,
                q,
                sf,
                inp.gemm2_out,
                inp.expanded_idx_to_permuted_idx,
                inp.expert_weights,
                inp.shared_output,
                inp.residual,
                inp.gamma,
                spec.routed_scaling_factor,
                spec.eps,
                spec.weight_bias,
                quant,
                scale,
                swz,
            )

        return fn

    return [mk(ws) for ws in wss], (wss, bufs)


def time_ranks(fns, sets: int, calls: int = 20, repeats: int = 15) -> float:
    # a copy of fusion_bridge.tuning.timing.time_graphs_per_rank: this script also runs against
    # trees
    # from before it existed (the A/B's "before" side)
    """Median us per call of W emulated ranks, each replaying its own CUDA graph of `calls` calls on
    its own stream, all at once (as W GPUs would: one graph holding every rank would not guarantee
    that its branches run concurrently, and a rank waiting alone for a peer times out)."""

    world = len(fns)
    streams = [torch.cuda.Stream() for _ in range(world)]
    main = torch.cuda.current_stream()

    def on_ranks(work):
        for r, s in enumerate(streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                work(r)
        for s in streams:
            main.wait_stream(s)

    for i in range(min(sets, 3)):
        on_ranks(lambda r, i=i: fns[r](i))
    torch.cuda.synchronize()
    graphs = []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[r](i % sets)
        graphs.append(graph)
    on_ranks(lambda r: graphs[r].replay())
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        on_ranks(lambda r: graphs[r].replay())
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def run_ranks(fns, streams, sets, outs):
    main = torch.cuda.current_stream()

    def fn(i):
        if len(fns) == 1:
            fns[0](sets[i][0], outs[0])
            return
        for r, (f, s) in enumerate(zip(fns, streams)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                f(sets[i][r], outs[r])
        for s in streams:
            main.wait_stream(s)

    return fn


def main() -> None:
    global label
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("label", help="this tree's name in the rows")
    ap.add_argument("reps", nargs="?", type=int, default=2, help="timings per point (2)")
    args = ap.parse_args()
    label, reps = args.label, args.reps
    every = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(0.05), "nvfp4": QuantSpec.nvfp4(336.0)}
    quants = {q: every[q] for q in QUANTS}
    for qname, qspec in quants.items():
        for T in TOKENS:
            spec = EpilogueSpec(
                hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=qspec, max_tokens=4096
            )
            per_set = T * H * 2 * (K + 6)
            n = sets_to_rotate(per_set, max_sets=32)
            sets1 = [
                make_inputs(spec, T, seed=i, device="cuda", skip_fraction=0.0) for i in range(n)
            ]
            qt = quant_tuple(spec)

            def local(i):
                s = sets1[i]
                red = fast.finalize_add(
                    s.gemm2_out,
                    s.expanded_idx_to_permuted_idx,
                    s.expert_weights,
                    s.shared_output,
                    spec.routed_scaling_factor,
                )
                fast.add_rmsnorm_quant(s.residual, red, s.gamma, spec.eps, spec.weight_bias, *qt)

            for _ in range(reps if LOCAL else 0):
                emit(f"local_2launch_{qname}", T, 1, "graph", time_graph(local, sets=n))
                emit(f"local_2launch_{qname}", T, 1, "eager", time_eager(local, sets=n))
            for kind, world in CASES:
                if qname != "none" and world != 2 and kind != "tp1":
                    continue
                if kind == "twoshot" and symm_twoshot is None:
                    print("symm_twoshot: skipped (this tree has no kernels/symm_twoshot.py)")
                    continue
                if kind == "oneshot" and T > 2048:
                    continue
                cap = 2048 if kind == "oneshot" else 4096
                group = kernel_group(kind, spec, world, cap)
                if group is None:
                    print(f"{kind}: skipped (this tree has no such kernels)")
                    continue
                fns, keep = group
                nw = max(1, n // world) if world > 1 else n
                sets = [
                    [
                        sets1[(i * world + r) % n]
                        if r == 0
                        else make_inputs(
                            spec, T, rank=r, seed=100 + i, device="cuda", skip_fraction=0.0
                        )
                        for r in range(world)
                    ]
                    for i in range(nw)
                ]
                outs = [outs_for(spec, T) for _ in range(world)]
                streams = [torch.cuda.Stream() for _ in range(world)]
                fn = run_ranks(fns, streams, sets, outs)
                per_rank = [(lambda i, r=r: fns[r](sets[i][r], outs[r])) for r in range(world)]
                for _ in range(reps):
                    g = time_graph(fn, sets=nw) if world == 1 else time_ranks(per_rank, sets=nw)
                    path = f"{'fused' if kind == 'tp1' else 'symm'}_{kind}_{qname}"
                    emit(path, T, world, "graph", g)
                    emit(path, T, world, "eager", time_eager(fn, sets=nw))
                torch.cuda.synchronize()
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"ab_{label}.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
