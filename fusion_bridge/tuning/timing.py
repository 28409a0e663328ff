"""Timing on the GPU (used by tuning and the benchmarks): CUDA graphs of many calls, events,
medians; inputs rotated beyond L2 or replayed.

Each measurement captures `calls` launches (cycling over `sets` input sets) in one CUDA graph,
replays it `repeats` times and reports the median time per call in microseconds.

Why not `triton.testing.do_bench_cudagraph` (read side by side, triton 3.6): it also unrolls calls
into one graph and times replays with events, but it replays one closure `fn()` and sizes the graph
from a local timing estimate (`n_repeat = rep / estimate_ms`). We keep ours for two
things it cannot do:
- inputs rotated inside the graph: call i uses input set i % sets, so one replay streams more than
  the L2 holds, as a real layer does (its closure sees the same tensors every call, L2-hot);
- the same number of captured calls on every rank, fixed by the caller: the candidates are
  collectives, and a per-rank estimate can differ between ranks, which would capture different
  numbers of all-reduces and hang the replay.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

L2_BYTES = 60 * 2**20  # H200


def sets_to_rotate(bytes_per_set: int, min_total: int = 4 * L2_BYTES, max_sets: int = 256) -> int:
    """How many input sets make one pass over them larger than the L2 several times over."""
    return max(2, min(max_sets, -(-min_total // max(bytes_per_set, 1))))


def time_graph(
    fn: Callable[[int], object], sets: int, calls: int = 0, repeats: int = 15, warmup: int = 2
) -> float:
    """Median microseconds per call of fn(i), i cycling over range(sets), captured in
    a CUDA graph."""
    calls = calls or max(sets, 20)
    for i in range(min(sets, 3)):
        fn(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def time_graphs_per_rank(
    fns: list[Callable[[int], object]], sets: int, calls: int = 20, repeats: int = 15
) -> float:
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


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written (GB/s): the better of the
    copy engine (copy_) and an SM elementwise kernel (mul by 1), which is what our kernels
    compete with."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = min(
        time_graph(lambda i: dst.copy_(src), sets=1, calls=10, repeats=10),
        time_graph(lambda i: torch.mul(src, 1, out=dst), sets=1, calls=10, repeats=10),
    )
    return 2 * nbytes / (us * 1e-6) / 1e9


def time_eager(fn: Callable[[int], object], sets: int, calls: int = 50, rounds: int = 7) -> float:
    """Median wall microseconds per call of back-to-back eager calls fn(i) (host launch cost and GPU
    time together: whichever bounds the stream), synchronized once per round."""
    import time

    for i in range(min(sets, 3)):
        fn(i)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            fn(i % sets)
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)
