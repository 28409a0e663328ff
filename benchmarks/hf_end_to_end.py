"""End to end on one GPU: what the bridge buys each supported transformers MoE family (issue 38).

    python benchmarks/hf_end_to_end.py --family deepseek_v3 qwen3_moe     # one GPU
    python benchmarks/hf_end_to_end.py --cpu-smoke                        # plumbing only, CPU

Per family it builds transformers' own model with random weights (no download) at the family's
real hidden size, top-k, expert / shared-expert intermediate sizes, attention shape and vocabulary,
with the number of routed experts cut (REAL states how many are kept) and as many decoder layers as
fit in --budget-gb of weights (default 40 GB), at most --max-layers (default 8); the cut is
printed. It times the forward of one sequence of T tokens (no cache) for T in --tokens (default
1 16 128 1024 4096):

- eager, in --rounds alternated rounds (default 5; each round runs the three variants in a rotated
  order, --iters forwards each, the round's value the median): the median over rounds and its
  spread (min..max over rounds);
- under CUDA graphs (a captured forward replayed --iters times), where the unpatched model itself
  captures;

for three variants: the unpatched model, the model patched with strategy="separate" (the adapter's
own expert path with the unfused epilogue) and patched with strategy="auto". It prints per MoE
layer the time the fused epilogue saves (separate - auto) and the whole patch saves (unpatched -
auto); per layer where the patched eager forward's time goes (the adapter's routing + experts +
shared expert, the bridge's call, each as host time and as GPU time, and the rest of the forward);
and at T=128 (or the largest T below) each patched variant's worst logits error over the bound of
migration/examples/hf_moe_bound.py. --csv writes the rows in the harness schema
(benchmarks/harness.py). Nothing runs at import; `--help` works without a GPU.
"""

from __future__ import annotations

import ast
import contextlib
import statistics
import sys
import time
from typing import Optional

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks import harness  # noqa: E402

VARIANTS = ("unpatched", "separate", "auto")
TOKENS = (1, 16, 128, 1024, 4096)
CHECK_T = 128  # the T whose logits are checked against the bound (or the largest T below it)


# DeepSeek-V3 / -V2 / Kimi attention (MLA) and layout: one dense first layer
MLA = "q_lora_rank=1536 kv_lora_rank=512 qk_rope_head_dim=64 qk_nope_head_dim=128 v_head_dim=128"
MLA += " first_k_dense_replace=1"
# family -> (config class, model class, the config key of the routed expert count, the experts
# kept, the real text config but for the layer and expert counts). Real shapes: DeepSeek-V3,
# Kimi-K2.5's language model (timed alone: the vision tower does not run on text), DeepSeek-V2,
# GLM-4.5, Qwen2-57B-A14B, Qwen3-30B-A3B, Qwen3.5-397B-A17B's language model, Mixtral-8x7B,
# MiniMax-M2, gpt-oss-120b.
REAL = {
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM", "n_routed_experts", 32,
        "hidden_size=7168 intermediate_size=18432 moe_intermediate_size=2048 vocab_size=129280 "
        "num_attention_heads=128 num_key_value_heads=128 num_experts_per_tok=8 n_group=8 "
        "topk_group=4 routed_scaling_factor=2.5 n_shared_experts=1 " + MLA,
    ),
    "kimi_k25": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM", "n_routed_experts", 32,
        "hidden_size=7168 intermediate_size=18432 moe_intermediate_size=2048 vocab_size=163840 "
        "num_attention_heads=64 num_key_value_heads=64 num_experts_per_tok=8 n_group=1 "
        "topk_group=1 routed_scaling_factor=2.827 n_shared_experts=1 " + MLA,
    ),
    "deepseek_v2": (
        "DeepseekV2Config", "DeepseekV2ForCausalLM", "n_routed_experts", 32,
        "hidden_size=5120 intermediate_size=12288 moe_intermediate_size=1536 vocab_size=102400 "
        "num_attention_heads=128 num_key_value_heads=128 num_experts_per_tok=6 n_group=8 "
        "topk_group=3 routed_scaling_factor=16.0 n_shared_experts=2 "
        "topk_method='group_limited_greedy' " + MLA,
    ),
    "glm4_moe": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM", "n_routed_experts", 32,
        "hidden_size=5120 intermediate_size=12288 moe_intermediate_size=1536 vocab_size=151552 "
        "num_attention_heads=96 num_key_value_heads=8 head_dim=128 num_experts_per_tok=8 "
        "n_group=1 topk_group=1 routed_scaling_factor=2.5 n_shared_experts=1 "
        "first_k_dense_replace=1 use_qk_norm=True",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "num_experts", 64,
        "hidden_size=3584 intermediate_size=18944 moe_intermediate_size=2560 vocab_size=151936 "
        "shared_expert_intermediate_size=20480 num_attention_heads=28 num_key_value_heads=4 "
        "num_experts_per_tok=8 norm_topk_prob=False",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts", 128,
        "hidden_size=2048 intermediate_size=6144 moe_intermediate_size=768 vocab_size=151936 "
        "num_attention_heads=32 num_key_value_heads=4 head_dim=128 num_experts_per_tok=8 "
        "norm_topk_prob=True",
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "num_experts", 64,
        "hidden_size=4096 moe_intermediate_size=1024 shared_expert_intermediate_size=1024 "
        "vocab_size=248320 num_attention_heads=32 num_key_value_heads=2 head_dim=256 "
        "num_experts_per_tok=10 linear_num_key_heads=16 linear_num_value_heads=64 "
        "linear_key_head_dim=128 linear_value_head_dim=128",
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM", "num_local_experts", 8,
        "hidden_size=4096 intermediate_size=14336 vocab_size=32000 num_attention_heads=32 "
        "num_key_value_heads=8 num_experts_per_tok=2",
    ),
    "minimax_m2": (
        "MiniMaxM2Config", "MiniMaxM2ForCausalLM", "num_local_experts", 64,
        "hidden_size=3072 intermediate_size=1536 vocab_size=200064 num_attention_heads=48 "
        "num_key_value_heads=8 head_dim=128 num_experts_per_tok=8",
    ),
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM", "num_local_experts", 32,
        "hidden_size=2880 intermediate_size=2880 vocab_size=201088 num_attention_heads=64 "
        "num_key_value_heads=8 head_dim=64 num_experts_per_tok=4 sliding_window=128",
    ),
}  # fmt: skip


def _parse(spec: str) -> dict:
    """ "a=1 b='x'" -> {"a": 1, "b": "x"} (Python literals)."""
    return {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in spec.split())}


def _config(family: str, layers: int, smoke: bool):
    """The family's config with `layers` decoder layers (real shapes, or the CPU smoke size)."""
    import transformers

    if smoke:
        from migration.examples.hf_moe_models import TINY, _configs

        common = dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], num_hidden_layers=3)
        common.update(num_attention_heads=TINY["heads"], num_experts_per_tok=TINY["top_k"])
        common.update(max_position_embeddings=256, experts_implementation="batched_mm")
        class_name, kwargs = _configs(family, TINY, common)
        if "text_config" in kwargs:  # a wrapper: time its language model alone
            kwargs = kwargs["text_config"]
            class_name = REAL[family][1]
            kwargs.pop("model_type", None)
        return getattr(transformers, REAL[family][0])(**kwargs), class_name
    config_class, class_name, experts_key, experts, real = REAL[family]
    kwargs = dict(_parse(real), num_hidden_layers=layers, max_position_embeddings=8192)
    kwargs[experts_key] = experts
    if family == "qwen3_5_moe":  # three linear-attention layers per full-attention layer
        kwargs["layer_types"] = [
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
        ]
    if family == "gpt_oss":
        kinds = ("sliding_attention", "full_attention")
        kwargs["layer_types"] = [kinds[i % 2] for i in range(layers)]
    return getattr(transformers, config_class)(**kwargs), class_name


def _weights_gb(family: str, layers: int) -> float:
    """The model's bf16 weights in GB, counted on the meta device (nothing allocated)."""
    import transformers

    config, class_name = _config(family, layers, smoke=False)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    return sum(p.numel() for p in model.parameters()) * 2 / 1e9


def size_for(family: str, budget_gb: float, max_layers: int = 16) -> tuple[int, float]:
    """(decoder layers, weights GB): the most layers (at least 2) within budget_gb."""
    best = (2, _weights_gb(family, 2))
    for layers in range(3, max_layers + 1):
        gb = _weights_gb(family, layers)
        if gb > budget_gb:
            break
        best = (layers, gb)
    return best


def build(family: str, layers: int, device: torch.device, smoke: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config, class_name = _config(family, layers, smoke)
    # built on the device in bf16, with the modules transformers keeps in fp32 (routers) in fp32
    with torch.device(device):
        model = getattr(transformers, class_name)._from_config(config, dtype=torch.bfloat16)
    return model.eval()


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(model, ids: torch.Tensor, iters: int) -> float:
    """Median microseconds of one eager forward (wall, synchronized per forward)."""
    times = []
    with torch.no_grad():
        for i in range(iters + 2):  # two warm-up forwards
            _sync(ids.device)
            start = time.perf_counter()
            model(ids, use_cache=False)
            _sync(ids.device)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def time_graph(model, ids: torch.Tensor, iters: int) -> float:
    """Median microseconds of one replay of a captured forward (CUDA events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(ids, use_cache=False)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del graph
    return statistics.median(times)


@contextlib.contextmanager
def variant(model, name: str, max_tokens: int = max(TOKENS)):
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


def breakdown(model, ids: torch.Tensor, iters: int, max_tokens: int) -> dict:
    """Where the patched (auto) eager forward's time goes, per MoE layer: the adapter's expert
    share and the bridge's call (host us and, on CUDA, GPU us each), and the rest of the forward's
    wall time outside those two (per forward)."""
    cuda = ids.device.type == "cuda"
    with variant(model, "auto", max_tokens) as patch, torch.no_grad():
        experts, bridge = Clock(cuda), Clock(cuda)
        for layer in patch.layers.values():
            layer.expert_share = experts.wrap(layer.expert_share)
            layer._finalize = bridge.wrap(layer._finalize)
        time_eager(model, ids, 1)  # warm-up with the clocks on
        experts.take(), bridge.take()
        wall = 0.0
        for _ in range(iters):
            _sync(ids.device)
            start = time.perf_counter()
            model(ids, use_cache=False)
            _sync(ids.device)
            wall += (time.perf_counter() - start) * 1e6
        (eh, eg), (bh, bg) = experts.take(), bridge.take()
        moe_layers = len(patch.layers)
    n = iters * moe_layers
    per = dict(experts_host_us=eh / n, bridge_host_us=bh / n)
    if cuda:
        per.update(experts_gpu_us=eg / n, bridge_gpu_us=bg / n)
    per["rest_us"] = (wall - eh - bh) / iters
    per["moe_layers"] = moe_layers
    return per


def agreement(model, ids: torch.Tensor, max_tokens: int) -> dict:
    """Each patched variant's worst per-token logits error over the bound (hf_moe_bound.py) on the
    tokens whose routing agreed with the unpatched model's (tainted_positions), and how many
    tokens a routing flip took out of the comparison."""
    from migration.examples.hf_moe_bound import Recorder, tainted_positions

    recorder = Recorder(model)
    out = {}
    with torch.no_grad():
        recorder.start()
        ref = model(ids, use_cache=False).logits.float()
        ref_call = recorder.calls[0]
        bound = recorder.bound(ref_call, model, 1)[1].to(ref.device).view(ref.shape[:-1])
        for name in VARIANTS[1:]:
            with variant(model, name, max_tokens):
                recorder.start()
                new = model(ids, use_cache=False).logits.float()
            tainted, _ = tainted_positions(
                [ref_call["routing"]], [recorder.calls[0]["routing"]], recorder, 1
            )
            clean = torch.tensor([p not in tainted[0] for p in range(ids.shape[1])])
            rel = ((new - ref).norm(dim=-1) / ref.norm(dim=-1) / bound)[0].cpu()
            worst = float(rel[clean].max()) if clean.any() else float("nan")
            out[name] = (worst, int((~clean).sum()))
    recorder.remove()
    return out


def run_family(family: str, args, rows: harness.Rows) -> None:
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        layers, gb = 3, 0.0
    else:
        layers, gb = size_for(family, args.budget_gb, args.max_layers)
    model = build(family, layers, device, args.cpu_smoke)
    config = model.config
    blocks = [m for m in model.modules() if hasattr(m, "experts")]
    experts = blocks[0].experts.gate_up_proj.shape[0]
    shape = f"{family} H={config.hidden_size} K={config.num_experts_per_tok} E={experts} L={layers}"
    print(f"\n{shape}: {gb:.1f} GB of weights (routed experts and layers cut to fit the budget)")
    gen = torch.Generator().manual_seed(1)
    graphs = device.type == "cuda" and not args.no_graphs
    check = max([t for t in args.tokens if t <= CHECK_T] or [min(args.tokens)])
    for tokens in args.tokens:
        ids = torch.randint(1, config.vocab_size, (1, tokens), generator=gen).to(device)
        rounds = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for name in order:
                with variant(model, name, max(args.tokens)):
                    rounds[name].append(time_eager(model, ids, args.iters))
        eager = {v: statistics.median(ts) for v, ts in rounds.items()}
        graph = {}
        if graphs:
            for name in VARIANTS:
                with variant(model, name, max(args.tokens)):
                    try:
                        graph[name] = time_graph(model, ids, args.iters)
                    except Exception as exc:  # noqa: BLE001 - reported; the unpatched limit
                        print(f"  T={tokens} {name}: no CUDA graph ({type(exc).__name__}: {exc})")
                        if name == "unpatched":
                            break
        split = breakdown(model, ids, args.iters, max(args.tokens))
        moe = split["moe_layers"]
        agree = agreement(model, ids, max(args.tokens)) if tokens == check else {}
        for name in VARIANTS:
            spread = (min(rounds[name]), max(rounds[name]))
            extra = dict(mode="eager", rounds=args.rounds, spread_us=spread, moe_layers=moe)
            if name == "auto":
                extra.update(split)
            if name in agree:
                extra["logits_err_over_bound"], extra["tokens_after_a_flip"] = agree[name]
            rows.add(name, "fusion_bridge", shape, tokens, eager[name], **extra)
            if name in graph:
                rows.add(name, "fusion_bridge", shape, tokens, graph[name], mode="graph")
        _print(tokens, eager, rounds, graph, split, agree)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del model


def _print(tokens, eager, rounds, graph, split, agree) -> None:
    moe = split["moe_layers"]
    spans = [f"{v} {eager[v]:.0f} ({min(rounds[v]):.0f}..{max(rounds[v]):.0f})" for v in VARIANTS]
    count = len(rounds["auto"])
    print(f"  T={tokens:5d} eager us (median of {count} rounds, min..max): " + ", ".join(spans))
    print(
        f"          per MoE layer, eager: fused epilogue saves "
        f"{(eager['separate'] - eager['auto']) / moe:.1f} us, the patch saves "
        f"{(eager['unpatched'] - eager['auto']) / moe:.1f} us; patched auto per layer: adapter "
        f"experts {split['experts_host_us']:.0f} us host"
        + (f" / {split['experts_gpu_us']:.0f} us GPU" if "experts_gpu_us" in split else "")
        + f", bridge {split['bridge_host_us']:.0f} us host"
        + (f" / {split['bridge_gpu_us']:.0f} us GPU" if "bridge_gpu_us" in split else "")
        + f"; rest of the forward {split['rest_us']:.0f} us"
    )
    if len(graph) == len(VARIANTS):
        print(
            "          CUDA graph us: "
            + ", ".join(f"{v} {graph[v]:.0f}" for v in VARIANTS)
            + "; per MoE layer: fused epilogue saves "
            f"{(graph['separate'] - graph['auto']) / moe:.1f} us, the patch saves "
            f"{(graph['unpatched'] - graph['auto']) / moe:.1f} us"
        )
    if agree:
        print(
            "          logits error / bound (<= 1 expected) on the tokens routed as unpatched: "
            + ", ".join(
                f"{v} {e:.2f} ({n} tokens after a routing flip)" for v, (e, n) in agree.items()
            )
        )


def main(argv=None) -> int:
    ap = harness.add_common(harness.parser(__doc__), tokens=list(TOKENS))
    ap.add_argument("--family", nargs="+", choices=list(REAL), default=None)
    ap.add_argument("--rounds", type=int, default=5, help="alternated eager rounds")
    ap.add_argument("--iters", type=int, default=20, help="forwards per measurement")
    ap.add_argument("--budget-gb", type=float, default=40.0, help="weights budget per model")
    ap.add_argument("--max-layers", type=int, default=8, help="decoder layers at most")
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny models on CPU, T 1 and 16, one round: checks the script, measures nothing",
    )
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.tokens = [t for t in args.tokens if t <= 16] or [1, 16]
        args.rounds, args.iters = 1, 2
        torch.set_num_threads(1)  # tiny models: more threads only wait for each other
    elif not torch.cuda.is_available():
        print("hf_end_to_end: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    rows = harness.Rows()
    for family in args.family or list(REAL):
        run_family(family, args, rows)
    if args.csv:
        rows.write(args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
