"""Hugging Face transformers MoE models on the bridge, against the unmodified model.

    python -m migration.examples.hf_moe --world-size 2     # gloo on CPU; NCCL when 2 GPUs exist

Builds small random-weight models from transformers configs (no download) of each supported family
(DeepSeek-V3: dense layer, shared expert, routed scaling, grouped routing; Qwen3-MoE: no shared
expert, a dense layer between MoE layers), runs the unmodified model (forward + greedy generate),
patches it with `patch_moe_epilogues(model, group=...)` and runs it again; prints how far the
logits moved against the bound derived in `logits_bound`, whether greedy generation agrees, and
which strategy each patched layer runs. The same model is built on every rank (same seed).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fusion_bridge.integrations.transformers import patch_moe_epilogues

U_BF16 = 2.0**-8  # one rounding to bf16 moves a value by at most this, relative

# hidden 256, 3 layers, 16 experts, top-4 (DeepSeek: dense, MoE, MoE; Qwen3: MoE, dense, MoE)
SMALL = {"hidden": 256, "inter": 512, "moe_inter": 64, "experts": 16, "top_k": 4, "layers": 3}
LARGE = {"hidden": 2048, "inter": 4096, "moe_inter": 256, "experts": 16, "top_k": 4, "layers": 3}
FAMILIES = ("deepseek_v3", "qwen3_moe")


def build_model(family: str, size: dict, seed: int = 0, device="cpu") -> torch.nn.Module:
    """A random-weight bf16 model of `family` in eval mode. Norm weights and DeepSeek's routing bias
    are randomised too (the defaults, ones and zeros, would hide a wrong gamma or bias)."""
    import transformers

    torch.manual_seed(seed)
    device = torch.device(device)
    h = size["hidden"]
    common = dict(
        vocab_size=512,
        hidden_size=h,
        intermediate_size=size["inter"],
        moe_intermediate_size=size["moe_inter"],
        num_hidden_layers=size["layers"],
        num_attention_heads=4,
        num_experts_per_tok=size["top_k"],
        max_position_embeddings=256,
        norm_topk_prob=True,
        # transformers' default experts path (grouped_mm) is CUDA-graph safe but slow on CPU
        experts_implementation="batched_mm" if device.type == "cpu" else None,
    )
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            n_routed_experts=size["experts"],
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=size["experts"],
            mlp_only_layers=[1],
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"build_model: family must be one of {FAMILIES}, got {family!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape))
    return model.to(device=device, dtype=torch.bfloat16).eval()


def epilogue_roundings(model: torch.nn.Module, world: int) -> int:
    """Roundings (in u^2 units) by which one MoE layer's output differs between the unmodified
    model and the patched one, relative to that output:
      - unmodified: transformers' grouped_mm (its default) and batched_mm experts round the top-k
        sum once (DeepSeek's weights are fp32; Qwen3's are bf16, so each of the K weighted rows is
        rounded too: K more), and DeepSeek rounds routed + shared once more; the eager experts
        round every weighted row and every index_add (2K, + 1 for the shared add);
      - bridge: each rank rounds its partial once (W), the all-reduce rounds W-1 sums, and a
        shared expert split over W ranks rounds W partial down_proj outputs instead of one (W-1)."""
    cfg = model.config
    top_k, shared = cfg.num_experts_per_tok, bool(getattr(cfg, "n_shared_experts", 0))
    if getattr(cfg, "_experts_implementation", None) == "eager":
        unmodified = 2 * top_k + int(shared)
    else:
        unmodified = 2 if shared else top_k + 1
    return unmodified + world + (world - 1) + ((world - 1) if shared else 0)


def logits_bound(
    magnitudes: dict, moe_layers: list, epilogue: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, norm-wise: (bound on |n_patched - n_unmodified| / |n_unmodified| for the final
    normed hidden state n, bound on |logits_patched - logits_unmodified| / |logits_unmodified|),
    tensors shaped like the tokens, while both models route the token, and every token it attends
    to, to the same experts.

    One rounding to bf16 moves an element by <= u = 2^-8 relative; independent roundings add in
    quadrature (n of them: sqrt(n)*u norm-wise). E tracks |residual_patched - residual_unmodified|^2
    in units of u^2, layer by layer, from the unmodified model's own per-token magnitudes
    (`magnitudes[layer]`: |layer input|, |attention output|, |after attention|, |MLP output|,
    |layer output|):
      - a residual add rounds in both models once their inputs differ: 2 at the sum's size;
      - the RMSNorm the bridge computes: the unmodified model rounds the normalized row and then
        its product with the weight (2), the bridge once (1): 3; a norm both compute on differing
        inputs: 2; the norm passes on its input's relative error (it is scale-invariant);
      - a sublayer passes on its input's relative error amplified by A^2 norm-wise at its output's
        size: attention A^2 = 1 (linear in its input at fixed softmax weights; the weights move by
        the same relative amount, times the spread of the scores, which random small weights keep
        below 1), gated MLP / experts A^2 = 2 (silu(gate) * up: two linear maps of the input whose
        errors add in quadrature);
      - an MoE layer adds `epilogue` roundings (epilogue_roundings) at its output's size;
      - at the end: the final norm (3 if the bridge computed it, else 2) and the lm_head's output
        rounding (2); the lm_head, a random linear map, keeps the relative error.
    """
    err = None
    prev_moe = False
    for layer in sorted(magnitudes):
        r0, attn, r1, mlp, r2 = magnitudes[layer]
        if err is None:
            err = torch.zeros_like(r0)
        differs = bool(err.any()) or prev_moe
        eps_in = err / r0**2 + (3 if prev_moe else (2 if differs else 0))
        err = err + attn**2 * eps_in + (2 * r1**2 if differs else 0)
        differs = differs or layer in moe_layers
        eps_mlp = err / r1**2 + (2 if bool(err.any()) else 0)
        err = err + 2 * mlp**2 * eps_mlp + (epilogue * mlp**2 if layer in moe_layers else 0)
        err = err + (2 * r2**2 if differs else 0)
        prev_moe = layer in moe_layers
    last = magnitudes[max(magnitudes)][4]
    hidden = err / last**2 + (3 if prev_moe else 2)
    return torch.sqrt(hidden) * U_BF16, torch.sqrt(hidden + 2) * U_BF16


class Recorder:
    """Forward hooks on the model's own modules (the same modules run in the unmodified and the
    patched model), per forward call: each MoE layer's top-k experts (sorted), and in the unmodified
    model the per-token magnitudes logits_bound needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(model, model.base_model_prefix).layers
        self.moe_layers = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
        self.last_layer = len(layers) - 1
        self.calls: list[dict] = []
        self._handles = [
            getattr(model, model.base_model_prefix).norm.register_forward_hook(self._final)
        ]
        for i, layer in enumerate(layers):
            self._handles += [
                layer.register_forward_pre_hook(self._pre(i), with_kwargs=True),
                layer.self_attn.register_forward_hook(self._store(i, "attn")),
                layer.mlp.register_forward_hook(self._store(i, "mlp")),
                layer.register_forward_hook(self._store(i, "out")),
            ]
            if i in self.moe_layers:
                self._handles.append(layer.mlp.gate.register_forward_hook(self._route(i)))

    @staticmethod
    def _norms(t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(-1, t.shape[-1]).norm(dim=-1).cpu()

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if index == 0:
                self.calls.append({"routing": {}, "mag": {}})
            self.calls[-1]["mag"][index] = {"in": args[0] if args else kwargs["hidden_states"]}

        return hook

    def _store(self, index: int, what: str):
        def hook(module, args, output):
            self.calls[-1]["mag"][index][what] = output[0] if isinstance(output, tuple) else output

        return hook

    def _final(self, module, args, output):
        self.calls[-1]["final_norm"] = self._norms(output)

    def _route(self, index: int):
        def hook(module, args, output):
            self.calls[-1]["routing"][index] = output[2].sort(-1).values.cpu()

        return hook

    def start(self) -> None:
        self.calls = []

    def magnitudes(self, call: dict) -> dict:
        out = {}
        for layer, m in call["mag"].items():
            after_attn = m["in"].float() + m["attn"].float()
            out[layer] = tuple(
                self._norms(t) for t in (m["in"], m["attn"], after_attn, m["mlp"], m["out"])
            )
        return out

    def routing(self) -> list[dict]:
        return [c["routing"] for c in self.calls]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def compare(model, group, world: int, prompt: torch.Tensor, new_tokens: int, **patch_options):
    """Unmodified model, then patched: forward logits and greedy generate. -> summary dict."""
    recorder = Recorder(model)
    batch, seq = prompt.shape
    epilogue = epilogue_roundings(model, world)
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
    ref, ref_calls, ref_gen, ref_gen_calls = runs["unmodified"]
    new, new_calls, new_gen, new_gen_calls = runs["patched"]
    moe = recorder.moe_layers
    bound = logits_bound(recorder.magnitudes(ref_calls[0]), moe, epilogue)[1].view(batch, seq)
    tainted, flips = tainted_positions(
        [c["routing"] for c in ref_calls], [c["routing"] for c in new_calls], recorder, batch
    )
    rel = ((new - ref).norm(dim=-1) / ref.norm(dim=-1)).cpu()
    clean = torch.tensor([[p not in tainted[b] for p in range(seq)] for b in range(batch)])
    # per step and sequence: the bound on |n_patched - n_unmodified| for the final normed hidden
    # state n of the token whose logits pick the next one
    step_bounds = [
        (logits_bound(recorder.magnitudes(c), moe, epilogue)[0] * c["final_norm"]).view(batch, -1)[
            :, -1
        ]
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
        **steps,
    }


class Tainted:
    """Positions of one sequence the bound does not cover: single positions, and every position
    from `start` on."""

    def __init__(self) -> None:
        self.single: set[int] = set()
        self.start = float("inf")

    def __contains__(self, pos: int) -> bool:
        return pos in self.single or pos >= self.start


def tainted_positions(ref: list[dict], new: list[dict], recorder: Recorder, batch: int):
    """Per sequence, the positions whose logits the bound does not cover: a token routed
    differently in layer l taints itself and, unless l is the last layer (no attention after it),
    every later position of its sequence. Forward call c covers positions [start, start + its
    length). -> (list of Tainted, [(layer, sequence, position) of each routing flip])."""
    tainted = [Tainted() for _ in range(batch)]
    flips, start = [], 0
    for ref_call, new_call in zip(ref, new):
        length = 0
        for layer, ids in ref_call.items():
            ids = ids.view(batch, -1, ids.shape[-1])
            length = ids.shape[1]
            other = new_call[layer].view(batch, -1, ids.shape[-1])
            for b, p in (ids != other).any(-1).nonzero().tolist():
                flips.append((layer, b, start + p))
                if layer == recorder.last_layer:
                    tainted[b].single.add(start + p)
                else:
                    tainted[b].start = min(tainted[b].start, start + p)
        start += length
    return tainted, flips


def generate_steps(ref_gen, new_gen, ref_calls, new_calls, recorder, step_bounds, lm_head) -> dict:
    """Per sequence and step: asserted when routing agreed so far and the unmodified model's gap
    between its top two logits l_a - l_b exceeds what the bound lets it move: the gap is
    (w_a - w_b) . n for lm_head rows w and final normed hidden n, so it moves by at most
    |w_a - w_b| * |n_patched - n_unmodified| (Cauchy-Schwarz; step_bounds bounds the second factor)
    plus each model's rounding of the two logits, u * (|l_a| + |l_b|) each. Else reported."""
    batch = ref_gen.sequences.shape[0]
    prompt_len = ref_gen.sequences.shape[1] - len(ref_gen.logits)
    tainted, _ = tainted_positions(
        [c["routing"] for c in ref_calls], [c["routing"] for c in new_calls], recorder, batch
    )
    covered_disagree, reported, covered = [], [], 0
    for b in range(batch):
        for s, (ref_logits, new_logits) in enumerate(zip(ref_gen.logits, new_gen.logits)):
            pos = prompt_len - 1 + s
            if not torch.equal(ref_gen.sequences[b, : pos + 1], new_gen.sequences[b, : pos + 1]):
                break  # the contexts differ from here on; nothing more to compare
            row = ref_logits[b].float()
            top2 = row.topk(2)
            gap = float(top2.values[0] - top2.values[1])
            w_a, w_b = lm_head[top2.indices[0]], lm_head[top2.indices[1]]
            threshold = float((w_a - w_b).norm().cpu()) * float(step_bounds[s][b])
            threshold += 2 * U_BF16 * float(top2.values.abs().sum())
            same = int(row.argmax()) == int(new_logits[b].float().argmax())
            if gap > threshold and pos not in tainted[b]:
                covered += 1
                if not same:
                    covered_disagree.append((b, s, gap, threshold))
            else:
                reported.append({"seq": b, "step": s, "gap": gap, "same": same})
    return {
        "generate_identical": torch.equal(ref_gen.sequences, new_gen.sequences),
        "generate_covered_steps": covered,
        "generate_covered_disagree": covered_disagree,
        "generate_reported_steps": reported,
    }


def run_rank(rank: int, world: int, families=FAMILIES, size=SMALL, new_tokens: int = 16) -> list:
    import torch.distributed as dist

    device = (
        torch.device("cuda", rank)
        if torch.cuda.is_available() and torch.cuda.device_count() >= world
        else torch.device("cpu")
    )
    group = dist.group.WORLD if world > 1 else None
    results = []
    for family in families:
        model = build_model(family, size, seed=0, device=device)
        g = torch.Generator().manual_seed(1)  # the same prompt on every rank
        prompt = torch.randint(1, 512, (2, 12), generator=g).to(device)
        summary = compare(model, group, world, prompt, new_tokens)
        results.append({"family": family, "rank": rank, **summary})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--family", choices=FAMILIES, action="append")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    families = tuple(args.family or FAMILIES)
    if args.world_size == 1:
        per_rank = [run_rank(0, 1, families)]
    else:
        from fusion_bridge.cli.launch import run_distributed

        per_rank = run_distributed(run_rank, args.world_size, families, timeout_s=600)
    results = [r for rank in per_rank for r in rank]
    ok = all(
        r["max_rel_err_over_bound"] is not None
        and r["max_rel_err_over_bound"] <= 1
        and not r["generate_covered_disagree"]
        for r in results
    )
    if args.json:
        print(json.dumps({"agree": ok, "results": results}, indent=2, default=str))
        return 0 if ok else 1
    for r in sorted(results, key=lambda r: (FAMILIES.index(r["family"]), r["rank"])):
        if r["rank"] == 0:
            strategies = ", ".join(f"layer {i}: {s}" for i, s in r["strategies"].items())
            print(f"{r['family']} (world {args.world_size}): {strategies}")
        split = [s for s in r["generate_reported_steps"] if not s["same"]]
        where = (
            f"first differs at sequence {split[0]['seq']} step {split[0]['step']}, top-two gap "
            f"{split[0]['gap']:.3g} (below what the bound allows)"
            if split
            else "identical"
        )
        print(
            f"  rank {r['rank']}: logits vs unmodified, max per-token rel err "
            f"{r['max_rel_err_clean']:.2e} over {r['clean_tokens']}/{r['tokens']} tokens "
            f"(bound {r['bound_range'][0]:.2e}..{r['bound_range'][1]:.2e}, worst error/bound "
            f"{r['max_rel_err_over_bound']:.2f}); routing flips {r['routing_flips']}; "
            f"greedy generate: {where}; {r['generate_covered_steps']} steps above the gap "
            f"bound agree, {len(r['generate_reported_steps'])} below it"
        )
    print("patched and unmodified agree" if ok else "patched and unmodified DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
