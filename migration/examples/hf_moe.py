"""Hugging Face transformers MoE models on the bridge, against the unmodified model.

    python -m migration.examples.hf_moe --world-size 2     # gloo on CPU; NCCL when 2 GPUs exist
    python -m migration.examples.hf_moe --world-size 2 --tp-plan auto            # TP plan
    python -m migration.examples.hf_moe --world-size 2 --tp-plan auto --expert-parallel   # TP + EP
    python -m migration.examples.hf_moe --world-size 2 --expert-parallel         # EP alone

Builds small random-weight models from transformers configs (no download) of every supported family
(hf_moe_models.FAMILIES: one per row of the family table; a family this transformers lacks, or whose
code here the patch refuses, is skipped with the reason), runs the unmodified model (forward +
greedy generate with a KV cache), patches it with `patch_moe_epilogues(model, group=...)` and runs
it again, then unpatches it and runs the forward a third time; prints how far the patched logits
moved against the bound derived in `logits_bound` (hf_moe_bound.py), whether greedy generation
agrees, which strategy each patched layer runs, and whether unpatching restored the model exactly.
The same model and the same prompt are built on every rank (same seeds).

With `--tp-plan auto` and/or `--expert-parallel` (transformers 5.25 for expert parallelism;
`accelerate` installed) the models are saved with `save_pretrained` once and every rank loads
them sharded with transformers' own machinery: `from_pretrained(path, tp_plan="auto")`, or
`distributed_config=DistributedConfig(tp_size=W, ep_size=W)` (with `tp_plan={}` for expert
parallelism alone); the patch then runs over the model's own TP group. Every rank still feeds the
model the same inputs, which is transformers' own tensor-parallel contract.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fusion_bridge.integrations.transformers import UnsupportedModelError, patch_moe_epilogues

from migration.examples.hf_moe_bound import Recorder, generate_steps, tainted_positions
from migration.examples.hf_moe_models import FAMILIES, LARGE, TINY, build_model, why_skipped

__all__ = ["FAMILIES", "LARGE", "TINY", "build_model", "compare", "run_rank", "main"]

PROMPT = (2, 8)  # batch, sequence


def _own_forwards(model: torch.nn.Module) -> dict:
    """{module name: its instance `forward`} before patching: transformers' TP / EP styles."""
    return {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}


def _patched_attributes(model: torch.nn.Module, own: dict) -> list[str]:
    """Modules that still carry an instance attribute the patch sets (a `forward` other than the
    module's own from before patching, `own`)."""
    names = ("moe_epilogue", "_fusion_bridge_patch", "_fusion_bridge_handoff")
    return [
        n
        for n, m in model.named_modules()
        if any(a in vars(m) for a in names) or vars(m).get("forward", own.get(n)) is not own.get(n)
    ]


def compare(model, group, world: int, prompt: torch.Tensor, new_tokens: int, **patch_options):
    """Unmodified model, then patched, then unpatched again: forward logits and greedy generate.
    -> summary dict."""
    own = _own_forwards(model)
    recorder = Recorder(model)
    batch, seq = prompt.shape
    gen = dict(max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    gen.update(output_logits=True, pad_token_id=0)
    runs = {}
    for name in ("unmodified", "patched"):
        patch = (
            patch_moe_epilogues(model, group=group, **patch_options) if name == "patched" else None
        )
        with torch.no_grad():
            recorder.start()
            logits = model(prompt).logits.float()
            forward_calls = recorder.calls
            recorder.start()
            out = model.generate(prompt, **gen)
            runs[name] = (logits, forward_calls, out, recorder.calls)
        if patch is not None:
            strategies = patch.strategies(batch * seq)
            norms_reused = patch.norms_reused
            explain = patch.explain(batch * seq)
            patch.unpatch()
    recorder.remove()
    with torch.no_grad():
        restored = model(prompt).logits.float()
    ref, ref_calls, ref_gen, ref_gen_calls = runs["unmodified"]
    new, new_calls, new_gen, new_gen_calls = runs["patched"]
    moe = recorder.moe_layers
    bound = recorder.bound(ref_calls[0], model, world)[1].view(batch, seq)
    tainted, flips = tainted_positions(
        [c["routing"] for c in ref_calls], [c["routing"] for c in new_calls], recorder, batch
    )
    rel = ((new - ref).norm(dim=-1) / ref.norm(dim=-1)).cpu()
    clean = torch.tensor([[p not in tainted[b] for p in range(seq)] for b in range(batch)])
    # per step and sequence: the bound on |n_patched - n_unmodified| for the final normed hidden
    # state n of the token whose logits pick the next one
    step_bounds = [
        (recorder.bound(c, model, world)[0] * c["final_norm"]).view(batch, -1)[:, -1]
        for c in ref_gen_calls
    ]
    lm_head = model.get_output_embeddings().weight.detach().float()
    steps = generate_steps(
        ref_gen, new_gen, ref_gen_calls, new_gen_calls, recorder, step_bounds, lm_head
    )
    return {
        "max_rel_err_over_bound": float((rel / bound)[clean].max()) if clean.any() else None,
        "max_rel_err_clean": float(rel[clean].max()) if clean.any() else None,
        "bound_range": (float(bound.min()), float(bound.max())),
        "clean_tokens": int(clean.sum()),
        "tokens": batch * seq,
        "routing_flips": flips,
        "first_moe_layer_routing_equal": all(
            torch.equal(r["routing"][moe[0]], n["routing"][moe[0]])
            for r, n in zip(ref_calls, new_calls)
        ),
        "max_rel_err_all": float(rel.max()),
        "logits_checksum": float(new.double().sum()),
        "strategies": strategies,
        "norms_reused": norms_reused,
        "patched_calls": len(new_calls) + len(new_gen_calls),
        "sequences": new_gen.sequences.tolist(),
        "moe_layers": moe,
        "explain": explain,
        "unpatch_restores_logits": torch.equal(restored, ref),
        "left_patched": _patched_attributes(model, own),
        **steps,
    }


def sharded_load(world: int, tp_plan: str | None, expert_parallel: bool) -> dict:
    """The from_pretrained keyword arguments of a sharded load ({}: build the model whole):
    tp_plan="auto" (transformers' TP plan), DistributedConfig(tp_size=W, ep_size=W) (TP + EP) or
    with tp_plan={} (EP alone)."""
    if not expert_parallel:
        return {"tp_plan": tp_plan} if tp_plan else {}
    import transformers

    extra = {} if tp_plan else {"tp_plan": {}}
    config = transformers.DistributedConfig(tp_size=world, ep_size=world, **extra)
    return {"distributed_config": config}


def _load_sharded(saved: tuple, rank: int, world: int, **kwargs) -> torch.nn.Module:
    """Every rank: the saved model (path, class name) loaded sharded by transformers."""
    import os

    import transformers

    # what torchrun sets, and transformers reads to size its mesh and pick the device
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    path, class_name = saved
    model_class = getattr(transformers, class_name)
    return model_class.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()


def run_rank(
    rank: int,
    world: int,
    families=FAMILIES,
    size=TINY,
    new_tokens: int = 6,
    saved: dict | None = None,
    sharded: tuple = (None, False),
    **patch_options,
) -> list:
    """Every family in `families` that this transformers has, on this rank: compare(...) with the
    same model and prompt on every rank. saved: {family: (path, class name)} of models saved with
    save_pretrained, loaded sharded as `sharded` = (tp_plan, expert_parallel) says
    (sharded_load); None: each rank builds the model whole."""
    import torch.distributed as dist

    device = (
        torch.device("cuda", rank)
        if torch.cuda.is_available() and torch.cuda.device_count() >= world
        else torch.device("cpu")
    )
    group = dist.group.WORLD if world > 1 else None
    results = []
    for family in families:
        why = why_skipped(family)
        if why is not None:
            results.append({"family": family, "rank": rank, "skipped": why})
            continue
        if saved is not None:
            model = _load_sharded(saved[family], rank, world, **sharded_load(world, *sharded))
            device = model.device
        else:
            model = build_model(family, size, seed=0, device=device)
        g = torch.Generator().manual_seed(1)  # the same prompt on every rank
        prompt = torch.randint(1, size["vocab"], PROMPT, generator=g).to(device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            summary = compare(model, group, world, prompt, new_tokens, **patch_options)
        except UnsupportedModelError as exc:  # a sharded layout the patch refuses, said why
            if saved is None:
                raise
            results.append({"family": family, "rank": rank, "skipped": str(exc)})
            continue
        results.append({"family": family, "rank": rank, "weight_bytes": weight_bytes, **summary})
    return results


def _line(r: dict) -> str:
    split = [s for s in r["generate_reported_steps"] if not s["same"]]
    where = (
        f"first differs at sequence {split[0]['seq']} step {split[0]['step']}, top-two gap "
        f"{split[0]['gap']:.3g} (below what the bound allows)"
        if split
        else "identical"
    )
    return (
        f"  rank {r['rank']}: logits vs unmodified, max per-token rel err "
        f"{r['max_rel_err_clean']:.2e} over {r['clean_tokens']}/{r['tokens']} tokens "
        f"(bound {r['bound_range'][0]:.2e}..{r['bound_range'][1]:.2e}, worst error/bound "
        f"{r['max_rel_err_over_bound']:.2f}); routing flips {r['routing_flips']}; "
        f"greedy generate: {where}; {r['generate_covered_steps']} steps above the gap "
        f"bound agree, {len(r['generate_reported_steps'])} below it; unpatch restores the "
        f"logits exactly: {r['unpatch_restores_logits'] and not r['left_patched']}"
    )


def _save(families, root: str) -> dict:
    """{family: (path, class name)}: every family this transformers has, built and saved under
    root with save_pretrained (the checkpoints the ranks load sharded)."""
    out = {}
    for family in families:
        if why_skipped(family) is None:
            model = build_model(family, TINY)
            model.save_pretrained(f"{root}/{family}")
            out[family] = (f"{root}/{family}", type(model).__name__)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--family", choices=FAMILIES, action="append")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--tp-plan",
        choices=["auto"],
        help="load the models sharded with transformers' TP plan (from_pretrained(tp_plan='auto'))",
    )
    ap.add_argument(
        "--expert-parallel",
        action="store_true",
        help="load them with transformers' expert parallelism: DistributedConfig(tp_size=W, "
        "ep_size=W), with tp_plan={} unless --tp-plan auto (transformers 5.25)",
    )
    args = ap.parse_args(argv)
    families = tuple(args.family or FAMILIES)
    sharded = (args.tp_plan, args.expert_parallel)
    if (args.tp_plan or args.expert_parallel) and args.world_size < 2:
        ap.error("--tp-plan / --expert-parallel need --world-size 2 or more")
    if args.expert_parallel:
        import transformers

        if not hasattr(transformers.DistributedConfig(), "ep_size"):
            ap.error(
                f"--expert-parallel needs transformers' DistributedConfig(ep_size=...) (5.25); "
                f"this is transformers {transformers.__version__}"
            )
    if args.world_size == 1:
        per_rank = [run_rank(0, 1, families)]
    else:
        import tempfile

        from fusion_bridge.cli.launch import run_distributed

        with tempfile.TemporaryDirectory(prefix="hf_moe_") as root:
            saved = _save(families, root) if args.tp_plan or args.expert_parallel else None
            per_rank = run_distributed(
                run_rank, args.world_size, families, TINY, 6, saved, sharded, timeout_s=600
            )
    results = [r for rank in per_rank for r in rank if "skipped" not in r]
    skipped = sorted({r["family"] for rank in per_rank for r in rank if "skipped" in r})
    ok = all(
        r["max_rel_err_over_bound"] is not None
        and r["max_rel_err_over_bound"] <= 1
        and not r["generate_covered_disagree"]
        and r["unpatch_restores_logits"]
        and not r["left_patched"]
        for r in results
    )
    if args.json:
        doc = {"agree": ok, "skipped": skipped, "results": results}
        print(json.dumps(doc, indent=2, default=str))
        return 0 if ok else 1
    for r in sorted(results, key=lambda r: (FAMILIES.index(r["family"]), r["rank"])):
        if r["rank"] == 0:
            strategies = ", ".join(f"layer {i}: {s}" for i, s in r["strategies"].items())
            print(f"{r['family']} (world {args.world_size}): {strategies}")
        print(_line(r))
    reasons = {r["family"]: r["skipped"] for rank in per_rank for r in rank if "skipped" in r}
    for family in skipped:
        print(f"{family}: skipped ({reasons[family]})")
    print("patched and unmodified agree" if ok else "patched and unmodified DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
