"""The per-token error bound hf_moe.py checks a patched model's logits against (`logits_bound`,
from `epilogue_roundings`), what it records from the unmodified model to compute it (`Recorder`),
the positions it does not cover (`tainted_positions`), and the greedy-generate check built on it
(`generate_steps`)."""

from __future__ import annotations

import torch

from migration.examples.hf_causal import mixer_term
from migration.examples.hf_delta_gain import DELTA_MIXERS, DeltaGain

U_BF16 = 2.0**-8  # one rounding to bf16 moves a value by at most this, relative

# Roundings to the activation dtype in one call of a family's RMSNorm (its forward, quoted):
#   Llama style (default; every other family's RMSNorm, the ones added with the family table
#   included: DeepSeek-V3.2, GLM-4-MoE-Lite, GLM-MoE-DSA, Mistral-4, Kimi-Linear, Qwen3-VL-MoE's
#   and Qwen3-Omni-MoE's text norms, OLMoE, ERNIE-4.5-MoE, HunYuan-MoE-V1, MiMo-V2-Flash, HY-V3,
#   GLM-4.5V's text norm, MiniCPM5-MoE, Mellum, Laguna, dots.3-note, DeepSeek-OCR-2's and
#   Unlimited-OCR's text norms, Bailing-Hybrid), `return self.weight *
#   hidden_states.to(input_dtype)`: the normalized row, then its product with the weight: 2;
#   GptOssRMSNorm, `return (self.weight * hidden_states).to(input_dtype)`: 1;
#   Qwen3_5MoeRMSNorm and Qwen3NextRMSNorm, `output = output * (1.0 + self.weight.float());
#   return output.type_as(x)`: 1.
NORM_ROUNDINGS = {
    "GptOssRMSNorm": 1,
    "Qwen3_5MoeRMSNorm": 1,
    "Qwen3NextRMSNorm": 1,
    "MiniMaxM3VLRMSNorm": 1,  # `output * (1.0 + self.weight.float()); return output.type_as(x)`
    "FlintRMSNorm": 1,  # `return (self.weight * hidden_states).to(input_dtype)`
    # `return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)`: one rounding
    "LaraMiniRMSNorm": 1,
}
# A^2 of a token mixer (see logits_bound): attention passes on its input's relative error once
# (1; the OCR models' and Lara-mini's plain attention, MLA and DeepSeek-V3.2's / GLM-MoE-DSA's
# sparse attention too, whose indexer keeps more tokens than the tests' sequences hold, so it
# attends to all as dense attention does); Qwen3.5's and Qwen3-Next's full attention multiply
# their output by sigmoid(gate(x)), a second linear path of the same input whose error adds in
# quadrature (2). The delta-rule mixers (hf_delta_gain.DELTA_MIXERS: the gated DeltaNet of
# Qwen3.5, Qwen3-Next and Lara-mini, the KDA of Kimi-Linear and Bailing-Hybrid) have no constant:
# their output is linear in q.k and in their state (no softmax), so where those cancel, its
# relative error exceeds its input's by far more than any constant (issue 47: measured on the
# CPU, bf16, at the one-GPU test's size, Qwen3-Next, up to thousands at a token whose DeltaNet
# output cancels); hf_delta_gain.DeltaGain derives theirs per call and token from the unmodified
# model's own recorded values. Measured (tests/integrations/test_hf_causal_bound.py, fp32, each
# input element moved by up to 2^-8): attention's A^2 up to 1.7 (Mixtral) and 13 (Qwen3-Next's
# gated attention) at the tiny size, 2.0 and 7.3 at the one-GPU test's: above these constants,
# which are not a proven bound (open).
MIXER_GAIN = {
    "Qwen3_5MoeAttention": 2,
    "Qwen3NextAttention": 2,
    # `attn_output * gate_states.sigmoid()`, its gate a half of q_gate_proj(x): as Qwen3-Next's
    "MiniCPM5MoeAttention": 2,
    # the output times a gate of a second linear path of the same input, as Qwen3-Next's: Laguna's
    # `F.softplus(self.g_proj(hidden_states))` (softplus' slope below 1), dots.3-note's per-head
    # `gate.sigmoid()` of g_proj(x) and Bailing-Hybrid's MLA `torch.sigmoid(self.g_proj(x))`
    "LagunaAttention": 2,
    "Dots3NoteTextAttention": 2,
    "BailingHybridAttention": 2,
}


def norm_roundings(norm: torch.nn.Module) -> int:
    """Roundings in one call of `norm` (NORM_ROUNDINGS)."""
    return NORM_ROUNDINGS.get(type(norm).__name__, 2)


def epilogue_roundings(model: torch.nn.Module, world: int, weights_dtype: torch.dtype) -> int:
    """Roundings (in u^2 units) by which one MoE layer's output differs between the unmodified
    model and the patched one, relative to that output; weights_dtype: the dtype of the router's
    top-k weights (recorded by Recorder).
      - unmodified: transformers' grouped_mm (its default) and batched_mm experts round the top-k
        sum once when the router's weights are fp32 (the weighted rows are fp32 then), and each
        of the K weighted rows too when they are in the activation dtype (K more); the eager
        experts round every weighted row and every index_add (2K); a shared expert is added to the
        routed output with one more rounding, and a gated one (Qwen2-MoE, Qwen3.5-MoE) is
        multiplied by its sigmoid gate with one more;
      - bridge: each rank rounds its partial once (W) and the all-reduce rounds W-1 sums;
      - split shared expert (W > 1): each rank rounds its partial down_proj output (and its gated
        product) where the unmodified model rounds the whole once: 1 + W each, at most at the
        whole's size (at W = 1 the patched shared expert runs the same ops on the same values);
      - a residual multiplier m (granitemoe: `residual + h * m`): the unmodified model rounds
        h * m once more; the bridge folds m into its fp32 scaling (no rounding), and a shared
        partial multiplied by m rounds once more on each rank (1 each);
      - a block that scales its routed output itself (minimax_m3_vl): one more rounding in the
        unmodified model, none in the bridge's fp32 scaling."""
    from fusion_bridge.integrations.hf_families import family_of

    family, lm = family_of(model)
    cfg = lm.config
    layer = next(layer for layer in lm.layers if family.moe_block(layer) is not None)
    moe = family.moe_block(layer)
    top_k = cfg.num_experts_per_tok
    shared = family.shared_module(moe, layer) is not None
    gated = shared and family.shared_gate_attr is not None
    if getattr(cfg, "_experts_implementation", None) == "eager":
        unmodified = 2 * top_k
    else:
        unmodified = 1 + (top_k if weights_dtype != torch.float32 else 0)
    unmodified += int(shared) + int(gated)
    split = (1 + world) * (int(shared) + int(gated)) if world > 1 else 0
    scaled = 0
    if family.multiplier(layer) != 1.0:
        scaled = 1 + (world if shared else 0)
    if family.block_scaling:  # the unmodified block rounds experts(x) * routed_scaling_factor
        scaled += 1
    return unmodified + world + (world - 1) + split + scaled


def _relative(err: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """err / magnitude^2 per token: the squared relative error of a value of norm `magnitude`
    whose squared absolute error is err. 0 where err is 0 (both models hold the same value, also
    where it is zero, as the padding token's zero embedding row at the first layer is); NaN where
    a zero value carries an error (no relative bound exists: the check fails rather than passing
    on an infinite bound)."""
    ratio = err / magnitude**2
    ratio = torch.where(err == 0, torch.zeros_like(ratio), ratio)
    return torch.where((err > 0) & (magnitude == 0), torch.full_like(ratio, float("nan")), ratio)


def logits_bound(
    magnitudes: dict,
    moe_layers: list,
    epilogue: int,
    norm: int,
    gains: dict,
    roundings: dict | None = None,
    shape: tuple[int, int] | None = None,
    carry: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, norm-wise: (bound on |n_patched - n_unmodified| / |n_unmodified| for the final
    normed hidden state n, bound on |logits_patched - logits_unmodified| / |logits_unmodified|),
    tensors shaped like the tokens, while both models route the token, and every token it attends
    to, to the same experts.

    One rounding to bf16 moves an element by <= u = 2^-8 relative; independent roundings add in
    quadrature (n of them: sqrt(n)*u norm-wise), and a rounding step both models take on values
    that differ counts once per model. E tracks |residual_patched - residual_unmodified|^2 in
    units of u^2, layer by layer, from the unmodified model's own per-token magnitudes
    (`magnitudes[layer]`: |layer input|, |token mixer output|, |after it|, |MLP output|, |layer
    output|):
      - a residual add rounds in both models once their inputs differ: 2 at the sum's size;
      - an RMSNorm of `norm` roundings (norm_roundings): where the bridge computes it, the
        unmodified model's `norm` and the bridge's one; where both compute it on differing
        inputs, 2 * norm; the norm passes on its input's relative error (it is scale-invariant);
      - a sublayer passes on its input's relative error amplified by A^2 norm-wise at its output's
        size: the MLP its own token's; the token mixer, whose output at position t reads every
        position <= t of its sequence (attention through its keys and values, a delta rule
        through its state), the largest of theirs (hf_causal.mixer_term: a running maximum over
        the sequence, continued by `carry`; the gains hold for one relative error over all the
        positions mixed, and grow with each one's, so the largest bounds them: issue 47, where
        an earlier position's error exceeds this one's, a padding token's, a cancelling
        output's). The token mixer's A^2 is `gains[layer]`, a number (MIXER_GAIN; plain
        attention 1: linear in its input at fixed softmax weights, the weights moving by the
        same relative amount times the spread of the scores, which random small weights keep
        below 1) or, for a delta-rule
        mixer, a tensor shaped like the tokens (hf_delta_gain.DeltaGain), which also adds
        `roundings[layer]` (u^2, per token: the mixer's own roundings of values that differ)
        wherever its input differs; gated MLP / experts A^2 = 2 (silu(gate) * up: two linear
        maps of the input whose errors add in quadrature);
      - an MoE layer adds `epilogue` roundings (epilogue_roundings) at its output's size;
      - at the end: the final norm (as above) and the lm_head's output rounding (2); the lm_head,
        a random linear map, keeps the relative error.
    A relative error is E over a squared magnitude (`_relative`); a zero magnitude with no error
    is no error: the padding token's embedding row is zero (nn.Embedding's padding_idx), and
    Mistral-4's pad_token_id (11) lies inside a random prompt of a 512-token vocabulary.

    `shape`: (B, S), the tokens flattened sequence by sequence (None: all of them one sequence,
    which bounds any split into sequences from above); `carry`: {layer: [B] running maximum of
    the token mixer's input error over the earlier calls of the same run}, a generate's decode
    steps continuing its prefill; None or {} for a first call; updated in place with this call's
    positions (`Recorder.bound` keeps it per run).
    """
    err = None
    prev_moe = False
    for layer in sorted(magnitudes):
        r0, attn, r1, mlp, r2 = magnitudes[layer]
        if err is None:
            err = torch.zeros_like(r0)
        differs = bool(err.any()) or prev_moe
        eps_in = _relative(err, r0) + (norm + 1 if prev_moe else (2 * norm if differs else 0))
        gain, rounds = gains.get(layer, 1), (roundings or {}).get(layer, 0)
        mixed = mixer_term(eps_in, gain, rounds, shape, carry, layer)
        err = err + attn**2 * mixed + (2 * r1**2 if differs else 0)
        differs = differs or layer in moe_layers
        eps_mlp = _relative(err, r1) + (2 * norm if bool(err.any()) else 0)
        err = err + 2 * mlp**2 * eps_mlp + (epilogue * mlp**2 if layer in moe_layers else 0)
        err = err + (2 * r2**2 if differs else 0)
        prev_moe = layer in moe_layers
    last = magnitudes[max(magnitudes)][4]
    hidden = _relative(err, last) + (norm + 1 if prev_moe else 2 * norm)
    return torch.sqrt(hidden) * U_BF16, torch.sqrt(hidden + 2) * U_BF16


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers (`.layers`) and the final norm (`.norm`): the base
    model, or a multimodal wrapper's language model, found as the patch finds it."""
    from fusion_bridge.integrations.hf_families import family_of

    return family_of(model)[1]


class Recorder:
    """Forward hooks on the model's own modules (the same modules run in the unmodified and the
    patched model), per forward call: each MoE layer's top-k experts (sorted) and the dtype of its
    router's weights, and in the unmodified model the per-token magnitudes logits_bound needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        from fusion_bridge.integrations.hf_families import family_of

        family, lm = family_of(model)
        layers = lm.layers
        self.moe_layers = [i for i, layer in enumerate(layers) if family.moe_block(layer)]
        # m of `residual + sublayer * m` (granitemoe): the hooks see the sublayers' outputs
        # before it, the residual stream gets them times m
        self.multipliers = {i: family.multiplier(layer) for i, layer in enumerate(layers)}
        self.last_layer = len(layers) - 1
        self.norm = norm_roundings(lm.norm)
        mixers = [type(self._mixer(layer)).__name__ for layer in layers]
        self.gains = {i: MIXER_GAIN.get(name, 1) for i, name in enumerate(mixers)}
        # a delta-rule mixer's gain, derived per call (recorded in call["gain"])
        self.delta = {
            i: DeltaGain(self._mixer(layer))
            for i, layer in enumerate(layers)
            if mixers[i] in DELTA_MIXERS
        }
        self.weights_dtype = None
        self.calls: list[dict] = []
        self._handles = [lm.norm.register_forward_hook(self._final)]
        for i, layer in enumerate(layers):
            self._handles += [
                layer.register_forward_pre_hook(self._pre(i), with_kwargs=True),
                self._mixer(layer).register_forward_hook(self._store(i, "attn")),
                (family.moe_block(layer) or layer.mlp).register_forward_hook(self._store(i, "mlp")),
                layer.register_forward_hook(self._store(i, "out")),
            ]
            shared = family.shared_module(family.moe_block(layer), layer)
            if family.shared_on_layer and shared is not None:  # added to the block's output
                self._handles.append(shared.register_forward_hook(self._store(i, "shared")))
            if i in self.moe_layers:
                router = family.router(family.moe_block(layer))
                self._handles.append(router.register_forward_hook(self._route(i)))

    @staticmethod
    def _mixer(layer: torch.nn.Module) -> torch.nn.Module:
        """The layer's token mixer: attention, or Qwen3.5's linear attention."""
        return getattr(layer, "self_attn", None) or layer.linear_attn

    @staticmethod
    def _norms(t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(-1, t.shape[-1]).norm(dim=-1).cpu()

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if index == 0:  # a new call: its (B, S), and the call of the same run before it
                prev = self.calls[-1] if self.calls else None
                call = {"routing": {}, "mag": {}, "gain": {}, "prev": prev, "carry": {}}
                # [B, S, H]; any other layout as one sequence (bounds any split from above)
                shape = tuple(x.shape[:2]) if x.dim() == 3 else (1, x.numel() // x.shape[-1])
                self.calls.append({**call, "shape": shape})
            self.calls[-1]["mag"][index] = {"in": x}

        return hook

    def _store(self, index: int, what: str):
        def hook(module, args, output):
            self.calls[-1]["mag"][index][what] = output[0] if isinstance(output, tuple) else output
            if what == "attn" and index in self.delta:  # its norm's hook has just derived it
                delta = self.delta[index]
                self.calls[-1]["gain"][index] = (delta.gain, delta.roundings)

        return hook

    def _final(self, module, args, output):
        self.calls[-1]["final_norm"] = self._norms(output)

    def _route(self, index: int):
        def hook(module, args, output):
            self.calls[-1]["routing"][index] = output[2].sort(-1).values.cpu()
            self.weights_dtype = output[1].dtype

        return hook

    def start(self) -> None:
        """A new run: no calls recorded, every delta-rule mixer's state forgotten."""
        self.calls = []
        for delta in self.delta.values():
            delta.reset()

    def bound(self, call: dict, model: torch.nn.Module, world: int):
        """logits_bound for one recorded call of the unmodified model; a call that continues the
        calls before it in the same run (a generate's decode step) continues their token mixers'
        running maxima (`carry`: each call keeps those at its end, computed on first need)."""
        epilogue = epilogue_roundings(model, world, self.weights_dtype)
        chain = [call]  # back to the first call of the run, or to one whose maxima are known
        while chain[-1]["prev"] is not None and epilogue not in chain[-1]["prev"]["carry"]:
            chain.append(chain[-1]["prev"])
        for c in reversed(chain):
            missing = sorted(set(self.delta) - set(c["gain"]))
            if missing:
                raise ValueError(f"call holds no derived gain of delta-rule layer(s) {missing}")
            gains = {**self.gains, **{i: g for i, (g, _) in c["gain"].items()}}
            rounds = {i: r for i, (_, r) in c["gain"].items()}
            carry = dict(c["prev"]["carry"][epilogue]) if c["prev"] is not None else {}
            out = logits_bound(
                self.magnitudes(c), self.moe_layers, epilogue, self.norm, gains, rounds,
                c["shape"], carry,
            )  # fmt: skip
            c["carry"][epilogue] = carry  # per epilogue count: the maxima depend on it
        return out

    def magnitudes(self, call: dict) -> dict:
        out = {}
        for layer, m in call["mag"].items():
            scale = self.multipliers[layer]
            mlp = m["mlp"].float() + (m["shared"].float() if "shared" in m else 0)
            attn, mlp = m["attn"].float() * scale, mlp * scale
            after_attn = m["in"].float() + attn
            out[layer] = tuple(self._norms(t) for t in (m["in"], attn, after_attn, mlp, m["out"]))
        return out

    def routing(self) -> list[dict]:
        return [c["routing"] for c in self.calls]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for delta in self.delta.values():
            delta.remove()


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
