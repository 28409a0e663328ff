"""Issue 42 on two GPUs of one host (NCCL, our kernels, FlashInfer): a failure on one rank before
its collective, whatever its class, keeps the group in step on every GPU route, and a negative view
is refused by the Triton paths. The CPU counterpart (gloo, `separate` and `local_fused_nccl` under
the interpreter) is tests/distributed/test_failure_protocol_round_two.py.

For each GPU strategy this machine can run, requested by name: rank 1 passes a negative view of
gemm2_out (refused, naming it), then a call whose input check raises KeyboardInterrupt; each is
followed by a good call. The peers must get all-NaN outputs and every good call must match the
float64 oracle; the failing rank raises its own error with the note that it took part. One spawned
group runs everything (a spawn and the workspaces cost seconds)."""

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed

pytestmark = pytest.mark.gpu
WORLD = 2
ROUTES = ("local_fused_nccl", "local_fused_flashinfer", "flashinfer_fused", "symm_fused_oneshot")


def _cpu(inputs):
    return inputs._replace(**{k: v.cpu() for k, v in inputs._asdict().items() if v is not None})


def _every_route(rank, world_size):
    import fusion_bridge.bridge as bridge_module
    from fusion_bridge import EpilogueSpec, FusionBridge
    from fusion_bridge.oracle.synthetic import make_inputs
    from tests import oracle64
    from tests.distributed.round_two_cases import _Inject

    spec = EpilogueSpec(hidden_size=7168, top_k=8, routed_scaling_factor=2.5, max_tokens=1024)
    dev = torch.device("cuda", rank)
    out = {}
    for name in ROUTES:
        try:
            bridge = FusionBridge(spec, strategy=name, device=dev)
        except ValueError as exc:  # cannot run here: say why, on every rank alike
            out[name] = {"skipped": str(exc)[:300]}
            continue
        results = []
        with bridge:
            for seed, how in enumerate(("negative_view", "keyboard_interrupt", None, None)):
                per_rank = [
                    make_inputs(spec, 16 + seed, rank=r, seed=seed, device=dev)
                    for r in range(world_size)
                ]
                inputs = per_rank[rank]
                if rank == 1 and how is not None:
                    inputs = inputs._replace(gemm2_out=torch._neg_view(inputs.gemm2_out))
                    if how == "keyboard_interrupt":  # raised by the check the view sends it to
                        _Inject(bridge_module, "validate_inputs", KeyboardInterrupt())
                try:
                    got = bridge(*inputs)
                    torch.cuda.synchronize(dev)
                    r = {"kind": "ok", "nan": bool(torch.isnan(got.norm_out).all())}
                    if how is None:
                        res, norm = oracle64.epilogue64_from(spec, [_cpu(p) for p in per_rank])
                        r["err"] = max(
                            oracle64.normwise_rel_err(got.residual_out.cpu(), res),
                            oracle64.normwise_rel_err(got.norm_out.cpu(), norm),
                        )
                except BaseException as exc:  # noqa: BLE001 - returned to the parent
                    r = {
                        "kind": type(exc).__name__,
                        "msg": str(exc)[:300],
                        "notes": list(getattr(exc, "__notes__", [])),
                    }
                r["how"] = how
                results.append(r)
        bound = next(s.error_bound for s in bridge.statuses if s.name == name)
        out[name] = {"results": results, "bound": bound}
    torch.distributed.barrier()
    return out


def test_a_failure_before_the_collective_keeps_every_gpu_route_in_step():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    per_rank = run_distributed(_every_route, WORLD, backend="nccl", timeout_s=900)
    ran = [name for name in ROUTES if "results" in per_rank[0][name]]
    assert "local_fused_nccl" in ran, per_rank[0]
    for rank, out in enumerate(per_rank):
        for name in ran:
            for r in out[name]["results"]:
                where = (rank, name, r["how"])
                if r["how"] is None:
                    assert r["kind"] == "ok" and not r["nan"], where
                    assert r["err"] <= out[name]["bound"], (where, r["err"])
                elif rank == 1:
                    expected = (
                        "KeyboardInterrupt"
                        if r["how"] == "keyboard_interrupt"
                        else ("EpilogueInputError")
                    )
                    assert r["kind"] == expected, (where, r)
                    assert any("took part" in n for n in r["notes"]), (where, r)
                else:
                    assert r["kind"] == "ok" and r["nan"], (where, "the peer gets NaN", r)
