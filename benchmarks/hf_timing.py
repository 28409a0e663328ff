"""The timing of benchmarks/hf_end_to_end.py: one eager forward, a captured forward's replay, a
model as a variant runs it (unpatched, or patched with a strategy), and the rounds that alternate
the variants in one process, eager and under CUDA graphs (benchmarks/hf_verdict.py judges them).
Nothing runs at import.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Callable, Optional

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])


class Clock:
    """Host and (on CUDA) GPU time of regions, summed per forward: wraps a callable."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.spans = cuda, []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start, first = time.perf_counter(), self._event() if self.cuda else None
            out = fn(*args, **kwargs)
            last = self._event() if self.cuda else None
            self.spans.append((first, last, start, time.perf_counter()))
            return out

        return timed

    def _event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def take(self) -> tuple[float, Optional[float]]:
        """(host us, GPU us) summed over the regions since the last take."""
        if self.cuda:
            torch.cuda.synchronize()
        host = sum(end - start for _, _, start, end in self.spans) * 1e6
        gpu = sum(a.elapsed_time(b) for a, b, _, _ in self.spans) * 1e3 if self.cuda else None
        self.spans = []
        return host, gpu


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(model, ids: torch.Tensor, iters: int, warm: int = 1) -> float:
    """Median microseconds of one eager forward (wall, synchronized per forward)."""
    times = []
    with torch.no_grad():
        for i in range(iters + warm):
            sync(ids.device)
            start = time.perf_counter()
            model(ids, use_cache=False)
            sync(ids.device)
            if i >= warm:
                times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def capture(model, ids: torch.Tensor) -> Callable[[], float]:
    """The model's forward on ids captured in a CUDA graph; returns replay() -> microseconds of
    one replay (CUDA events). On CPU (--cpu-smoke) a stand-in: replay() runs the model's forward
    as it is then, eagerly."""
    if ids.device.type != "cuda":
        return lambda: time_eager(model, ids, 1, warm=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(ids, use_cache=False)

    def replay() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e3

    return replay


@contextlib.contextmanager
def variant(model, name: str, max_tokens: int):
    """The model as `name` runs it: unpatched, or patched with that strategy (unpatched after)."""
    if name == "unpatched":
        yield None
        return
    from fusion_bridge.integrations.transformers import patch_moe_epilogues

    patch = patch_moe_epilogues(model, strategy=name, max_tokens=max_tokens)
    try:
        yield patch
    finally:
        patch.unpatch()


def eager_rounds(model, inputs: dict, variants: tuple, args, log) -> dict:
    """{variant: {T: [one median per round]}}: each round patches each variant once (order
    rotated round by round) and times every T."""
    out = {v: {t: [] for t in inputs} for v in variants}
    for r in range(args.rounds):
        for name in variants[r % len(variants) :] + variants[: r % len(variants)]:
            with variant(model, name, max(inputs)):
                for tokens, ids in inputs.items():
                    out[name][tokens].append(time_eager(model, ids, args.iters))
        log(f"eager round {r + 1}/{args.rounds}")
    return out


def graph_rounds(model, inputs: dict, variants: tuple, args, log) -> tuple[dict, dict]:
    """({variant: {T: [one median per round]}}, {(variant, T): why it has no rounds}). The
    unpatched graphs are captured first and kept; per patched variant its graphs are captured
    under the patch, the rounds alternate the two replays, and its graphs are freed before the
    patch is undone. The unpatched rounds are those alternated with auto."""
    out = {v: {t: [] for t in inputs} for v in variants}
    notes, unpatched = {}, {}
    for tokens, ids in inputs.items():
        try:
            unpatched[tokens] = capture(model, ids)
        except Exception as exc:  # noqa: BLE001 - the unpatched model's own limit, reported
            for v in variants:
                for t in inputs:
                    notes[(v, t)] = f"the unpatched model does not capture: {short_error(exc)}"
            return out, notes
    for name in variants[1:]:
        with variant(model, name, max(inputs)):
            patched = {}
            try:
                for tokens in unpatched:
                    try:
                        patched[tokens] = capture(model, inputs[tokens])
                    except Exception as exc:  # noqa: BLE001 - a miss, reported
                        notes[(name, tokens)] = (
                            f"patched {name} does not capture: {short_error(exc)}"
                        )
                for r in range(args.rounds):
                    for tokens, replay in patched.items():
                        pair = [("unpatched", unpatched[tokens]), (name, replay)]
                        for who, fn in pair[:: 1 if r % 2 == 0 else -1]:
                            us = statistics.median(fn() for _ in range(args.iters))
                            if who == name or name == "auto":
                                out[who][tokens].append(us)
            finally:
                patched.clear()  # the graphs read the patch's buffers: freed before unpatch
                sync(next(iter(inputs.values())).device)
        log(f"CUDA graph rounds ({name})")
    return out, notes


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    print("benchmarks/hf_timing.py: the timing of hf_end_to_end.py; run that script")
    return 0


if __name__ == "__main__":
    sys.exit(main())
