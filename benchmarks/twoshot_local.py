"""The large-T path's local work on ONE GPU: the two-shot (`kernels/symm/twoshot.py`) with a world
of 1 (no peers: every row is its own, no peer reads, no all-gather, no link traffic) beside our
finalize kernel alone and our add+RMSNorm kernel alone, measured in the same run. Target: the
two-shot <= finalize + add_rmsnorm.

    python benchmarks/twoshot_local.py [--tokens 1024 4096 8192] [--hidden 7168 4096] [--csv PATH]
        [--twoshot LABEL... | all] [--ablate]

Prints (and writes as CSV) one table: per (H, T) our finalize alone, our add+RMSNorm alone, their
sum, each two-shot row's time, its ratio to the sum and its workspace per rank (MB). Labels: the
CONFIGS launch configs (`AblationConfig` fields, each on buffers laid out for it: the product's
launch choices made free again, built here from the product's own launch helpers) and the
VARIANTS labels (the strategy's launches as it makes them). Every row is first checked against
the two standalone kernels' outputs (residual_out bitwise equal: the same roundings; norm_out
close: the two-shot norms the rounded residual_out) and its error word. `--ablate` adds, per
label, its finalize launches alone (`_only_F`), its row launches alone (`_only_R`) and everything
but the finalize on one stream (`_no_F`): the slot counters preset so no gate holds them, outputs
not all written. CUDA graphs, inputs rotated past L2, median us per call.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402
from fusion_bridge.kernels.symm import twoshot as symm_twoshot  # noqa: E402
from fusion_bridge.kernels.symm.twoshot_kernels import FLAG_ARRIVED, FLAG_REDUCED  # noqa: E402
from fusion_bridge.kernels.symm.twoshot_streams import two_streams  # noqa: E402
from fusion_bridge.tuning.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph  # noqa: E402


@dataclass(frozen=True)
class AblationConfig:
    """A two-shot launch with the choices the product fixes made free again (defaults: the
    product's, kernels/symm/twoshot.py). chunk, f_cols, slots, pdl: `TwoshotConfig`'s. f_warps:
    the finalize items' warps; row_warps: the row launches' (0: our add+RMSNorm kernel's choice);
    l2: 0 no L2 hints, 1 the hints, 2 the hints and the read slot rows dropped; stream_mode: "two"
    (F on f_streams side streams, the rest on the caller's stream), "two_prio" (the rest on a
    high-priority stream; a call of one chunk as "two") or "one" (every launch in order on the
    caller's stream); f_ahead: False is the earlier order ("f_after_x"): F(c + 1) gated by X(c),
    after F(c), instead of by V(c) right after R(c - 1) / G(c - 1)."""

    chunk: int = symm_twoshot.CHUNK
    f_cols: int = 1024
    slots: int = symm_twoshot.SLOTS
    pdl: bool = True
    f_warps: int = symm_twoshot.F_WARPS
    row_warps: int = 0
    stream_mode: str = "two_prio"
    f_streams: int = symm_twoshot.F_STREAMS
    l2: int = symm_twoshot.L2_HINTS
    f_ahead: bool = True

    def __post_init__(self):
        if self.stream_mode not in ("one", "two", "two_prio"):
            raise ValueError(f"stream_mode: expected one, two or two_prio: {self.stream_mode!r}")
        if self.l2 not in (0, 1, 2) or self.f_streams not in (1, 2):
            raise ValueError(f"l2 0..2, f_streams 1..2: got {self.l2}, {self.f_streams}")

    def product(self) -> symm_twoshot.TwoshotConfig:
        """The product's config these fields contain (its validation included)."""
        names = {f.name for f in fields(symm_twoshot.TwoshotConfig)}
        return symm_twoshot.TwoshotConfig(**{n: getattr(self, n) for n in names})


def launches(layer, config: AblationConfig, records: tuple) -> tuple:
    """(the product's launch callables, this config's sequence of them): the same kernels and
    arguments the product launches (`symm_twoshot._call_launches`), the choices of `config`;
    records: the call's (RowSource, RowOutputs)."""
    calls = symm_twoshot._call_launches(
        layer, config.product(), *records, False, l2=config.l2, f_warps=config.f_warps,
        row_warps=config.row_warps,
    )  # fmt: skip
    seq = symm_twoshot._sequence(calls, split=False) if config.f_ahead else _f_after_x(calls)
    return calls, seq


def launch(layer, config: AblationConfig, records: tuple) -> None:
    """One call in `config` (as `symm_twoshot.TwoshotLauncher` makes one in the product's)."""
    calls, seq = launches(layer, config, records)
    if config.stream_mode == "one":
        for _, _, fn, _ in seq:
            fn()
    else:
        prio = config.stream_mode == "two_prio" and len(calls.plans) > 1
        two_streams(records[0].residual.device, seq, prio, config.f_streams)


def _f_after_x(calls) -> list:
    """The earlier order (the product's before issue 37): F(c), then X(c) releasing chunk c - 1
    and gating chunk c - 1 + SLOTS, R(c), Y(c), G(c); one gate first, one release last."""
    n, world, sync, slots = len(calls.plans), calls.world, calls.sync, calls.slots
    first = min(slots, n)
    seq = [("Q", 0, sync(0, gate=(0, first)), list(range(first)))]
    for p in calls.plans:
        c = p.index
        g = c - 1 + slots  # the chunk whose slot chunk c - 1 frees
        gated = [g] if c > 0 and g < n else []
        release = c - 1 if c > 0 else None
        seq += [("F", c, calls.f(p), [])]
        x = sync(c, FLAG_ARRIVED, FLAG_ARRIVED, release, False, (g, len(gated)))
        seq += [("X", c, x, gated), ("R", c, calls.r(p, False), [])]
        if world > 1:
            seq += [("Y", c, sync(c, FLAG_REDUCED, FLAG_REDUCED), [])]
            seq += [("G", c, calls.r(p, True), [])]
    return seq + [("Z", n - 1, sync(n - 1, release=n - 1, advance=True), [])]


# label -> AblationConfig fields. "default" is the product's config (2 slots x 1024 tokens, F on 2
# side streams, L2 2, PDL, row launches on a high-priority stream, f_ahead). The labels after it
# were measured against the earlier default, "f_after_x" (rows on the caller's stream, F(c + 1)
# gated by X(c)), and keep meaning a change to that one
_F_AFTER_X = dict(stream_mode="two", f_ahead=False)
CONFIGS = {
    "default": dict(),
    "f_after_x": _F_AFTER_X,
    # F(c + 1) gated by its own release-and-gate launch right after R(c - 1), not by X(c): without
    # and with the row launches on a high-priority stream (the latter is the default)
    "f_ahead": dict(stream_mode="two"),
    "f_ahead_prio": dict(),
    "c512_s4_f1_nol2": _F_AFTER_X | dict(chunk=512, slots=4, f_streams=1, l2=0),  # the first
    "c1024_s2_f1_nol2": _F_AFTER_X | dict(f_streams=1, l2=0),
    "c1024_s2_f2_nol2": _F_AFTER_X | dict(l2=0),
    "l2_hints": _F_AFTER_X | dict(l2=1),  # the hints without the row drops
    "prio": _F_AFTER_X | dict(stream_mode="two_prio"),
    "one_stream": _F_AFTER_X | dict(stream_mode="one"),
    # programmatic dependent launch off / on (sm_90+; kernels/pdl.py)
    "pdl_off": _F_AFTER_X | dict(pdl=False),
    "pdl_on": _F_AFTER_X | dict(pdl=True),
    # longer chunks (workspace 2x / 4x the default's): with --ablate, whether the row launches'
    # excess over add+RMSNorm is per launch (ramp and drain) or per row (each row program's
    # dependent loads before its data loads; benchmarks/results/staged_rows_offline_sass.md)
    "c2048_s2": _F_AFTER_X | dict(chunk=2048),
    "c4096_s2": _F_AFTER_X | dict(chunk=4096),
    # the launch configs of the two halves: the row launches at 8 warps (our add+RMSNorm's choice
    # is 16 at H=7168), the finalize items at 8 warps over 1024 or 2048 columns
    "rw8": _F_AFTER_X | dict(row_warps=8),
    "fw8": _F_AFTER_X | dict(f_warps=8),
    "f2048_w8": _F_AFTER_X | dict(f_cols=2048, f_warps=8),
}
# the two-shot strategy's launch (its one variant, "default": symm_twoshot.TwoshotLauncher)
VARIANTS = {"twoshot_default": None}


def main() -> None:
    ap = parser(__doc__)
    add_common(ap, tokens=[1024, 4096, 8192], hidden=[7168, 4096])
    ap.add_argument("--twoshot", nargs="+", default=["default"], help="labels or 'all'")
    ap.add_argument("--ablate", action="store_true", help="also time the stages alone")
    args = ap.parse_args()
    from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
    from fusion_bridge.kernels.finalize_add import finalize_add_into
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    labels = list(CONFIGS) + list(VARIANTS) if args.twoshot == ["all"] else args.twoshot
    copy_gbs = round(copy_bandwidth_gbs(1 << 30), 1)
    rows = []  # one per (H, T, label): the table the target reads
    none = torch.empty(0, dtype=torch.uint8, device="cuda")
    keep = []

    def record(name, hidden, tokens, us):
        print(f"{name:36s} H={hidden} T={tokens:5d} {us:9.2f} us", flush=True)

    for hidden in args.hidden:
        spec = EpilogueSpec(hidden_size=hidden, top_k=8, routed_scaling_factor=2.5)
        for tokens in args.tokens:
            n = sets_to_rotate(tokens * hidden * 2 * 14, max_sets=16)
            sets = [
                make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                for i in range(n)
            ]
            part = torch.empty(tokens, hidden, dtype=spec.dtype, device="cuda")
            ro, no = torch.empty_like(part), torch.empty_like(part)

            def fin(i):
                s = sets[i]
                finalize_add_into(
                    part, s.gemm2_out, s.expanded_idx_to_permuted_idx, s.expert_weights,
                    s.shared_output, spec.routed_scaling_factor,
                )  # fmt: skip

            def norm(i):
                add_rmsnorm_into(
                    ro, no, none, none, sets[i].residual, part, sets[i].gamma, eps=spec.eps,
                    weight_bias=spec.weight_bias, quant=0, quant_scale=1.0, swizzled=False,
                )  # fmt: skip

            t_fin, t_norm = time_graph(fin, sets=n), time_graph(norm, sets=n)
            record("finalize_alone", hidden, tokens, t_fin)
            record("add_rmsnorm_alone", hidden, tokens, t_norm)
            record("standalone_sum", hidden, tokens, t_fin + t_norm)

            def row(label, us, mb):
                return dict(
                    H=hidden, T=tokens, finalize_alone_us=round(t_fin, 2),
                    add_rmsnorm_alone_us=round(t_norm, 2), sum_us=round(t_fin + t_norm, 2),
                    path=label, us=round(us, 2), ratio=round(us / (t_fin + t_norm), 3),
                    workspace_mb=round(mb, 1),
                )  # fmt: skip

            fin(0)
            norm(0)
            ref = (ro.clone(), no.clone())
            for label in labels:
                rows.extend(_twoshot_rows(label, record, row, spec, sets, n, part, ref, keep,
                                         args.ablate))  # fmt: skip
    print(f"\nHBM copy {copy_gbs} GB/s; W=1 local work vs our two standalone kernels (us, graph)")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.csv:
        out = Rows()
        out.add("hbm_copy", "hardware", "1 GiB", 0, None, gbs=copy_gbs)
        seen = set()
        for r in rows:  # the standalone kernels once per (H, T), then each two-shot row
            shape = f"H={r['H']} K=8 none"
            if (r["H"], r["T"]) not in seen:
                seen.add((r["H"], r["T"]))
                out.add("finalize_alone", "fusion_bridge", shape, r["T"], r["finalize_alone_us"])
                out.add("add_rmsnorm_alone", "fusion_bridge", shape, r["T"],
                        r["add_rmsnorm_alone_us"])  # fmt: skip
                out.add("standalone_sum", "fusion_bridge", shape, r["T"], r["sum_us"])
            out.add(r["path"], "fusion_bridge", shape, r["T"], r["us"], ratio=r["ratio"],
                    workspace_mb=r["workspace_mb"])  # fmt: skip
        out.write(args.csv)


def _twoshot_rows(label, record, row, spec, sets, n, part, ref, keep, ablate):
    """The two-shot at world size 1 in config CONFIGS[label], or (VARIANTS labels) as the strategy
    launches it: checked against the standalone kernels' outputs, then timed; `ablate` adds its
    finalize launches alone, its R launches alone and every launch but F on one stream (the slot
    counters preset so no gate holds them; outputs not all written)."""
    from fusion_bridge.kernels.symm.twoshot_device import FREED_BYTE, MAX_SLOTS
    from fusion_bridge.testing.symm_oneshot_rig import call_records
    from fusion_bridge.testing.symm_twoshot_rig import twoshot_layers_on_one_gpu

    hidden, tokens = part.shape[1], part.shape[0]
    strategy = label in VARIANTS  # the strategy's launch, else an ablation config
    config = AblationConfig(**({} if strategy else CONFIGS[label]))
    none = torch.empty(0, dtype=torch.uint8, device="cuda")

    def group_for():
        g = twoshot_layers_on_one_gpu(1, hidden, spec, 5.0, config=config)
        keep.append(g)  # the layer holds raw pointers into its buffer
        return g

    group = group_for()
    layer, err = group.layers[0], group.errs[0]
    out = (torch.full_like(part, float("nan")), torch.full_like(part, float("nan")), none, none)
    mb = group.buffers[0].numel() / 1e6

    product = symm_twoshot.TwoshotLauncher(layer)

    def twoshot(i):
        if strategy:
            product(*call_records(sets[i], out))
        else:
            launch(layer, config, call_records(sets[i], out))

    twoshot(0)
    torch.cuda.synchronize()
    same = torch.equal(out[0].view(torch.int16), ref[0].view(torch.int16))
    dn = (out[1].float() - ref[1].float()).abs().max().item()
    print(f"  check {label}: residual_out bitwise {same}, norm max diff {dn:.3g}, "
          f"err {int(err[0])}")  # fmt: skip
    if not same or int(err[0]) or not dn < 0.1:
        return [row(f"{label}_WRONG", float("nan"), mb)]
    us = time_graph(twoshot, sets=n)
    record(label, hidden, tokens, us)
    assert int(err[0]) == 0, hex(int(err[0]))
    out_rows = [row(label, us, mb)]
    if ablate:
        group_f = group_for()
        group_f.buffers[0][FREED_BYTE : FREED_BYTE + 8 * MAX_SLOTS].view(torch.int64).fill_(1 << 40)

        def only(stages):
            def fn_of(i):
                _, seq = launches(group_f.layers[0], config, call_records(sets[i], out))
                for stage, _, fn, _ in seq:
                    if stage in stages:
                        fn()

            return fn_of

        for tag, stages in (("only_F", "F"), ("only_R", "R"), ("no_F", "QVXRYGZ")):
            us = time_graph(only(stages), sets=n)
            record(f"{label}_{tag}", hidden, tokens, us)
            out_rows.append(row(f"{label}_{tag}", us, mb))
    return out_rows


if __name__ == "__main__":
    main()
