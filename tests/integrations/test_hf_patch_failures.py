"""Issue 54 items 1, 6 and 9 over a real gloo group of 2 ranks on CPU, with real tiny transformers
models (one spawned group runs every case; each test asserts one):

  1  the patch's own failure protocol: a failure on rank 1 inside the expert path of an MoE layer
     (in a forward, and in the block called directly), and in the attention of an MoE layer,
     makes rank 1 take part in the calls it did not make
     (FusionBridge.fail_call): rank 0's forward gives NaN logits, rank 1 raises the failure, and the
     next forward (and a new patch after unpatch()) gives every rank the clean forward's logits;
     in debug mode every rank raises the same GroupInputError instead. A forward that skips a
     layer's call without raising (a hook that replaced the block's output) is refused on every
     rank, and a new patch on that group raises saying what recovers.
  6  the model check covers buffers (e_score_correction_bias, the rotary inv_freq), the router's
     settings (topk_group, norm_topk_prob) and the spec each layer builds (routed_scaling_factor of
     one layer): named on every rank at patch time, before any bridge is built.
  9  patch_moe_epilogues(..., build_timeout_s=5) on one rank only ends within about that bound with
     an error naming what it waited for.

Items 4 and 5 (the handoff sees in-place edits, autograd refused) run on one rank:
test_hf_patch_one_rank.py.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import pytest
import torch

pytest.importorskip("transformers")

from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from tests.helpers import once_per_run  # noqa: E402

ERRING = 1  # the rank that fails
GROUP_TIMEOUT = timedelta(seconds=20)  # a collective here fails after this, never hangs
RUN_TIMEOUT_S = 300  # the whole spawned run (process start on a loaded 2-core machine included)
BUILD_TIMEOUT_S = 30.0  # every patch's check-in, when both ranks patch
ALONE_TIMEOUT_S = 5.0  # the check-in of the patch only rank 0 makes (item 9)
OPTIONS = dict(self_test=False, tuning="off", build_timeout_s=BUILD_TIMEOUT_S)


def _group(world_size):
    return torch.distributed.new_group(
        list(range(world_size)), timeout=GROUP_TIMEOUT, backend="gloo"
    )


def _forward(model, prompt) -> dict:
    try:
        with torch.no_grad():
            return {"kind": "ok", "logits": model(prompt).logits.float()}
    except BaseException as exc:  # noqa: BLE001 - the parent asserts on type and text
        notes = "\n".join(getattr(exc, "__notes__", []))
        return {"kind": type(exc).__name__, "msg": str(exc), "notes": notes}


def _fail_once(module, attr: str, error: BaseException) -> None:
    """module.attr raises `error` at its next call, then is the module's own again."""

    def broken(*args, **kwargs):
        del module.__dict__[attr]
        raise error

    module.__dict__[attr] = broken


def _raise_once(module, error: BaseException) -> None:
    """A forward pre-hook that raises `error` at the module's next call, then removes itself."""

    def hook(*_):
        handle.remove()
        raise error

    handle = module.register_forward_pre_hook(hook)


def _one_failure(rank, group, where: str, debug: bool = False) -> dict:
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    model = build_model("qwen3_moe", TINY)  # MoE layers 0 and 2 (layer 1 is dense)
    prompt = torch.randint(1, TINY["vocab"], (2, 8), generator=torch.Generator().manual_seed(3))
    out = {"own": _forward(model, prompt)}
    patch = patch_moe_epilogues(model, group, debug=debug, **OPTIONS)
    out["clean"] = _forward(model, prompt)
    if rank == ERRING:
        error = RuntimeError(f"injected failure in {where}")
        if where == "experts":  # inside layer 0's expert path: calls 0 and 2 left to take part in
            _fail_once(model.model.layers[0].mlp.experts, "_apply_gate", error)
        else:  # the attention of MoE layer 2, after layer 0's call
            _raise_once(model.model.layers[2].self_attn, error)
    out["failing"] = _forward(model, prompt)
    out["next"] = _forward(model, prompt)
    patch.unpatch()
    patch = patch_moe_epilogues(model, group, debug=debug, **OPTIONS)  # a new patch after it
    out["repatched"] = _forward(model, prompt)
    patch.unpatch()
    return out


def _skipped_call(rank, group) -> dict:
    """Both ranks' layer 0 block output replaced by a hook (its bridge call never made): the
    forward returns on every rank having made layer 2's call only."""
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    model = build_model("qwen3_moe", TINY)
    prompt = torch.randint(1, TINY["vocab"], (1, 5), generator=torch.Generator().manual_seed(4))
    patch = patch_moe_epilogues(model, group, **OPTIONS)
    handle = model.model.layers[0].mlp.register_forward_hook(
        lambda module, args, output: torch.zeros_like(args[0])
    )
    out = {"skipping": _forward(model, prompt)}
    handle.remove()
    out["after"] = _forward(model, prompt)
    patch.unpatch()
    try:
        patch_moe_epilogues(model, group, **OPTIONS)
        out["repatch"] = {"kind": "patched"}
    except BaseException as exc:  # noqa: BLE001
        out["repatch"] = {"kind": type(exc).__name__, "msg": str(exc)}
    return out


def _direct_block_call(rank, group) -> dict:
    """The patched block called directly (no forward of the model around it) as its decoder layer
    calls it, its expert path failing on rank 1 once, then again."""
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    model = build_model("qwen3_moe", TINY)
    patch = patch_moe_epilogues(model, group, **OPTIONS)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, TINY["hidden"], generator=torch.Generator().manual_seed(5))
    x = x.to(torch.bfloat16)
    out = {}
    if rank == ERRING:
        _fail_once(block.experts, "_apply_gate", RuntimeError("injected failure in experts"))
    for step in ("failing", "next"):
        try:
            with torch.no_grad():
                out[step] = {"kind": "ok", "values": (x + block(x)).float()}
        except BaseException as exc:  # noqa: BLE001
            notes = "\n".join(getattr(exc, "__notes__", []))
            out[step] = {"kind": type(exc).__name__, "msg": str(exc), "notes": notes}
    patch.unpatch()
    return out


def _model_differs(rank, group) -> dict:
    """Rank 1's model differs from rank 0's in one place per case."""
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    built = build_model("deepseek_v3", TINY)  # MoE layers 1 and 2
    out = {}
    for case in ("correction_bias", "topk_group", "norm_topk_prob", "inv_freq", "scaling"):
        model = copy.deepcopy(built)
        gate = model.model.layers[1].mlp.gate
        if rank == ERRING:
            with torch.no_grad():
                if case == "correction_bias":
                    gate.e_score_correction_bias.add_(0.5)
                if case == "inv_freq":
                    model.model.rotary_emb.inv_freq.mul_(1.01)
            if case == "topk_group":
                gate.topk_group += 1
            if case == "norm_topk_prob":
                gate.norm_topk_prob = not gate.norm_topk_prob
            if case == "scaling":  # one layer's factor: its spec differs, and rank 1 alone would
                # build a second bridge where rank 0 shares one
                model.model.layers[2].mlp.gate.routed_scaling_factor *= 2
        start = time.monotonic()
        try:
            patch = patch_moe_epilogues(model, group, **OPTIONS)
            patch.unpatch()
            out[case] = {"kind": "patched"}
        except BaseException as exc:  # noqa: BLE001
            out[case] = {"kind": type(exc).__name__, "msg": str(exc)}
        out[case]["seconds"] = time.monotonic() - start
    return out


def _alone(rank, group) -> dict:
    """Only rank 0 patches, with build_timeout_s=5; rank 1 waits for it at a barrier."""
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    out = {}
    if rank == 0:
        model = build_model("qwen3_moe", TINY)
        start = time.monotonic()
        try:
            patch_moe_epilogues(model, group, self_test=False, build_timeout_s=ALONE_TIMEOUT_S)
            out = {"kind": "patched"}
        except BaseException as exc:  # noqa: BLE001
            out = {"kind": type(exc).__name__, "msg": str(exc)}
        out["seconds"] = time.monotonic() - start
    torch.distributed.barrier()  # the default group: rank 1 leaves after rank 0's attempt
    return out


def _every_case(rank, world_size) -> dict:
    torch.set_num_threads(1)  # tiny models, two processes on a shared CPU
    group = _group(world_size)
    out = {
        "experts": _one_failure(rank, group, "experts"),
        "attention": _one_failure(rank, group, "attention"),
        "debug_attention": _one_failure(rank, group, "attention", debug=True),
        "debug_experts": _one_failure(rank, group, "experts", debug=True),
        "direct": _direct_block_call(rank, group),
        "model": _model_differs(rank, group),
    }
    out["skipped"] = _skipped_call(rank, _group(world_size))  # left out of step: a group of its own
    out["alone"] = _alone(rank, _group(world_size))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return once_per_run(
        tmp_path_factory,
        "hf_patch_failures",
        lambda _: run_distributed(_every_case, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S),
    )


def _assert_same(a: dict, b: dict, where) -> None:
    assert a["kind"] == "ok" and b["kind"] == "ok", (where, a, b)
    assert torch.equal(a["logits"], b["logits"]), where


@pytest.mark.parametrize("where", ["experts", "attention"])
def test_1_a_failure_before_a_layer_s_call_takes_part_and_the_next_forward_is_right(ranks, where):
    for rank, per_rank in enumerate(ranks):
        r = per_rank[where]
        # the clean patched forward: within 5% of the model's own logits (the family test holds it
        # to the derived bound; a call paired with another layer's call errs by 0.1-1, issue 54)
        own, clean = r["own"]["logits"], r["clean"]["logits"]
        assert float((clean - own).norm() / own.norm()) < 0.05, (rank, where)
        if rank == ERRING:
            assert r["failing"]["kind"] == "RuntimeError", r["failing"]
            assert f"injected failure in {where}" in r["failing"]["msg"]
            assert "took part in call" in r["failing"]["notes"] or (
                "took part in each with a NaN payload" in r["failing"]["notes"]
            ), r["failing"]["notes"]
        else:
            assert r["failing"]["kind"] == "ok", r["failing"]
            assert torch.isnan(r["failing"]["logits"]).all(), (rank, where)
        _assert_same(r["next"], r["clean"], (rank, where, "the next forward"))
        _assert_same(r["repatched"], r["clean"], (rank, where, "a new patch"))
    assert torch.equal(ranks[0][where]["next"]["logits"], ranks[1][where]["next"]["logits"])


def test_1_a_failure_in_a_block_called_directly_takes_part_in_its_call(ranks):
    for rank, per_rank in enumerate(ranks):
        r = per_rank["direct"]
        if rank == ERRING:
            assert r["failing"]["kind"] == "RuntimeError", r["failing"]
            assert "took part in call 1 with a NaN payload of T=5" in r["failing"]["notes"]
        else:
            assert r["failing"]["kind"] == "ok", r["failing"]
            assert torch.isnan(r["failing"]["values"]).all()
        assert r["next"]["kind"] == "ok" and torch.isfinite(r["next"]["values"]).all(), rank
    assert torch.equal(ranks[0]["direct"]["next"]["values"], ranks[1]["direct"]["next"]["values"])


@pytest.mark.parametrize("where", ["debug_attention", "debug_experts"])
def test_1_in_debug_mode_every_rank_raises_the_same_error_and_stays_in_step(ranks, where):
    for rank, per_rank in enumerate(ranks):
        r = per_rank[where]
        assert r["failing"]["kind"] == "GroupInputError", (rank, r["failing"])
        # the one agreement of the failing layer, naming rank 1's own error (not a later call's)
        failed = (
            "finalize_epilogue (debug mode, agreed on every rank before any collective): rank "
            f"{ERRING} of the 2-rank group failed the call's checks: rank {ERRING}: "
        )
        assert r["failing"]["msg"].startswith(failed + "RuntimeError: injected failure in"), r
        _assert_same(r["next"], r["clean"], (rank, where, "the next forward"))
        _assert_same(r["repatched"], r["clean"], (rank, where, "a new patch"))


def test_1_a_forward_that_skipped_a_layer_s_call_is_refused_and_so_is_a_new_patch(ranks):
    for rank, per_rank in enumerate(ranks):
        r = per_rank["skipped"]
        assert r["skipping"]["kind"] == "RuntimeError", (rank, r["skipping"])
        assert "bridge calls [2] where every forward makes [0, 2]" in r["skipping"]["msg"]
        assert r["after"]["kind"] == "EpilogueInputError", (rank, r["after"])
        assert "this FusionBridge is unusable" in r["after"]["msg"], r["after"]
        assert r["repatch"]["kind"] == "RuntimeError", (rank, r["repatch"])
        assert "went out of step on this rank" in r["repatch"]["msg"], r["repatch"]
        assert "destroy_process_group()" in r["repatch"]["msg"]


@pytest.mark.parametrize(
    "case, kind, name",
    [
        ("correction_bias", "buffers", "model.layers.1.mlp.gate.e_score_correction_bias"),
        ("inv_freq", "buffers", "model.rotary_emb.inv_freq"),
        ("topk_group", "settings", "model.layers.1.mlp.gate.topk_group"),
        ("norm_topk_prob", "settings", "model.layers.1.mlp.gate.norm_topk_prob"),
        ("scaling", "layer specs", "layer 2.routed_scaling_factor"),
    ],
)
def test_6_the_model_check_names_the_first_difference_before_any_bridge(ranks, case, kind, name):
    for rank, per_rank in enumerate(ranks):
        r = per_rank["model"][case]
        assert r["kind"] == "ValueError", (rank, case, r)
        assert f"rank {ERRING} differs from rank 0 in {kind} ['{name}'" in r["msg"], r["msg"]
        assert f"(first: {name}" in r["msg"], r["msg"]
        # named within the check-in's bound: the check-in and one all-gather, never a collective
        # left waiting (whose timeout would raise a RuntimeError, not this error)
        assert r["seconds"] < BUILD_TIMEOUT_S, (rank, case, r["seconds"])


def test_9_a_patch_on_one_rank_ends_within_build_timeout_s_naming_what_it_waited_for(ranks):
    r = ranks[0]["alone"]
    assert r["kind"] == "RankAgreementError", r
    assert "patch_moe_epilogues (the model check)" in r["msg"], r["msg"]
    assert "waited 5 s for rank(s) 1 to check in" in r["msg"], r["msg"]
    # the bound, plus the model's fingerprint work and a loaded machine's scheduling; gloo's own
    # timeout would be 30 minutes
    assert ALONE_TIMEOUT_S <= r["seconds"] < ALONE_TIMEOUT_S + 25, r["seconds"]
