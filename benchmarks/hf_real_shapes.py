"""The real per-family shapes that benchmarks/hf_end_to_end.py times, and how a model is built at
them (random weights, no download).

    python benchmarks/hf_real_shapes.py     # every family: its shape here, or why it is skipped

REAL holds, per family of migration/examples/hf_moe_models.FAMILIES (one name per builder there;
each is a row, or a wrapper of a row, of the patch's family table), its language model's config
as the public model's config.json has it (hidden size, top-k, routed / shared expert intermediate
sizes, attention heads / KV heads / head_dim, vocabulary, and what the family adds: MLA ranks,
linear-attention heads, multipliers), with two cuts: the routed experts (the count kept is the
number after the config key, the real count in the comment) and the decoder layers (at most one
dense layer first, so most of the few layers timed are MoE). A value not known from the public
config says so in its comment and is the transformers config class's own default. The model's
structure (its class, a multimodal wrapper with a one-layer vision tower that text-only input does
not run) is the CPU tests' builder's (hf_moe_models._configs), so the CPU smoke builds the same
classes at the tests' tiny size.

Data and building are apart: the rows are data with their sources (hf_real_shapes_table.py for
the families the table had first, with LAYOUT, the per-layer kinds; hf_real_shapes_late.py for
those added last), and this module only builds from them (config_for, build, describe, the
weights budget), so a new family is a row there and never a change here.
"""

from __future__ import annotations

import ast
import sys
from typing import Optional

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.hf_real_shapes_late import LATE_REAL  # noqa: E402
from benchmarks.hf_real_shapes_table import FIRST_REAL, LAYOUT  # noqa: E402

# family -> (the config key of the routed expert count, the experts kept, the language model's
# config): every family of the CPU tests' builders
REAL = {**FIRST_REAL, **LATE_REAL}


def parse(spec: str) -> dict:
    """ "a=1 b='x'" -> {"a": 1, "b": "x"} (Python literals)."""
    return {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in spec.split())}


def _tiny_common() -> dict:
    from migration.examples.hf_moe_models import TINY

    common = dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], num_hidden_layers=3)
    common.update(num_attention_heads=TINY["heads"], num_experts_per_tok=TINY["top_k"])
    return common


def config_for(family: str, layers: int, smoke: bool, cpu: bool = False):
    """(config, model class name) of `family`: at the CPU tests' tiny size (smoke: 3 layers), or at
    its real shape (REAL) with `layers` decoder layers. cpu: transformers' batched_mm experts path
    (its default, grouped_mm, is slow on CPU)."""
    import transformers
    from migration.examples.hf_moe_models import CONFIG_CLASS, TINY, _configs

    common = _tiny_common()
    common.update(max_position_embeddings=256, experts_implementation="batched_mm" if cpu else None)
    if smoke:
        class_name, kwargs = _configs(family, TINY, common)
    else:
        key, experts, spec = REAL[family]
        text = dict(parse(spec), num_hidden_layers=layers, **{key: experts})
        text.update({k: make(layers) for k, make in LAYOUT.get(family, {}).items()})
        # the structure (class, wrapper and its tiny towers) at the real hidden size
        class_name, kwargs = _configs(family, dict(TINY, hidden=text["hidden_size"]), common)
        if "text_config" in kwargs:
            if "model_type" in kwargs["text_config"]:  # e.g. Kimi-K2.5's "kimi_k2"
                text["model_type"] = kwargs["text_config"]["model_type"]
            kwargs["text_config"] = text
        else:
            kwargs = dict(text, experts_implementation=common["experts_implementation"])
    if "text_config" in kwargs:  # a wrapper sets the experts path of every sub-model
        kwargs["experts_implementation"] = common["experts_implementation"]
    return getattr(transformers, CONFIG_CLASS[family])(**kwargs), class_name


def why_skipped(family: str, device: torch.device) -> Optional[str]:
    """Why `family` is not timed with this transformers on `device` (its config class is missing,
    the patch refuses its modeling code here, or the patch's row refuses the device), or None."""
    from migration.examples.hf_moe_models import why_skipped as tests_reason

    from fusion_bridge.integrations.hf_families import FAMILIES

    reason = tests_reason(family)
    if reason is not None:
        import transformers

        return f"{reason} (transformers {transformers.__version__})"
    row = next((f for f in FAMILIES if family in f.model_types + f.wrappers), None)
    refusal = getattr(row, "cuda_refusal", None) if device.type == "cuda" else None
    return None if refusal is None else f"the patch refuses it on CUDA: {refusal}"


def weights_gb(family: str, layers: int) -> float:
    """The model's bf16 weights in GB at its real shape, counted on the meta device."""
    import transformers

    config, class_name = config_for(family, layers, smoke=False)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    return sum(p.numel() for p in model.parameters()) * 2 / 1e9


def size_for(family: str, budget_gb: float, max_layers: int) -> tuple[int, float]:
    """(decoder layers, weights GB): the most layers (at least 2, at most max_layers) within
    budget_gb; 2 where even those exceed it."""
    for layers in range(max_layers, 2, -1):  # the default run's models fit at once: one count
        gb = weights_gb(family, layers)
        if gb <= budget_gb:
            return layers, gb
    return 2, weights_gb(family, 2)


def build(family: str, layers: int, device: torch.device, smoke: bool) -> torch.nn.Module:
    """The model in eval mode, bf16 (the modules transformers keeps in fp32, its routers, fp32),
    built on `device` without transformers' initialisation; then every floating parameter drawn
    there: N(0, 0.02), norm weights N(1, 0.1) (the defaults, ones, would hide a wrong gamma), and
    the embeddings tied where the config ties them. Buffers (rotary frequencies, routing biases)
    are the constructors' own."""
    import transformers
    from transformers.initialization import no_init_weights

    config, class_name = config_for(family, layers, smoke, cpu=device.type == "cpu")
    with torch.device(device), no_init_weights():
        model = getattr(transformers, class_name)._from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                norm = name.endswith("norm.weight")
                p.normal_(1.0 if norm else 0.0, 0.1 if norm else 0.02, generator=generator)
    model.tie_weights()  # what the skipped init_weights also does (tied embeddings)
    return model.eval()


def describe(family: str, layers: int = 4) -> str:
    """One line: the family's real shape at `layers` layers, read back from the meta model."""
    import transformers

    from fusion_bridge.integrations.hf_families import family_of

    config, class_name = config_for(family, layers, smoke=False)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    row, text = family_of(model)
    blocks = [b for b in (row.moe_block(layer) for layer in text.layers) if b is not None]
    gb = sum(p.numel() for p in model.parameters()) * 2 / 1e9
    down = blocks[0].experts.down_proj  # [E, H, I] or [E, I, H] (transposed experts)
    return (
        f"{family}: {class_name} H={text.config.hidden_size} K={row.top_k(blocks[0])} "
        f"E={down.shape[0]} moe_inter={down[0].numel() // text.config.hidden_size} "
        f"vocab={text.config.vocab_size} L={layers} "
        f"({len(blocks)} MoE) {gb:.1f} GB"
    )


def main(argv=None) -> int:
    import argparse

    from migration.examples.hf_moe_models import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    args = ap.parse_args(argv)
    for family in FAMILIES:
        why = why_skipped(family, torch.device("cpu"))
        print(describe(family, args.layers) if why is None else f"{family}: skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
