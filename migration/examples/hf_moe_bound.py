"""The per-token error bound hf_moe.py checks a patched model's logits against (`logits_bound`,
from `epilogue_roundings`), what it records from the unmodified model to compute it (`Recorder`),
the positions it does not cover (`tainted_positions`), and the greedy-generate check built on it
(`generate_steps`)."""

from __future__ import annotations

import torch

U_BF16 = 2.0**-8  # one rounding to bf16 moves a value by at most this, relative


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
