"""The Hugging Face patch's check that every rank holds the same model and builds the same bridges,
before any bridge is built.

Every rank computes its share of the experts of one model; ranks whose models differ anywhere the
forward reads sum plausible, wrong partials. So the ranks compare, in one agreement:
  - the architecture (model type, hidden size, which layers are MoE);
  - the spec each MoE layer builds its bridge with (eps, routed_scaling_factor, shared output,
    top-k, ...): a layer whose spec differs would make one rank build a bridge where another
    shares one, and the builds would pair wrongly;
  - the settings the forward reads: every plain (bool, int, float, str) attribute of every module
    (the routers' `top_k`, `topk_group`, `n_group`, `norm_topk_prob`, `routed_scaling_factor`,
    the norms' eps, ...) and of the text config;
  - the content of every parameter and every buffer (the routing correction bias
    `e_score_correction_bias`, the rotary `inv_freq`): weights_digest; of a model transformers
    loaded sharded, the content of its replicated parameters and, for each sharded DTensor, its
    placements, global shape and whether its local shape is the one they give the rank
    (`shard_layouts`: a shard's content differs by rank by design). A shard whose local shape is
    not the expected one is refused even when every rank's is wrong alike.

Before that agreement (its first collective) every rank checks in through the process group's
store (`fusion_bridge.check_in`, bounded by `build_timeout_s` / FUSION_BRIDGE_BUILD_TIMEOUT_S), so
a rank that never patches is named within that bound rather than after the process group's
timeout. The one error every rank raises names the first difference (and how many more).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge import EpilogueSpec, check_in
from fusion_bridge.integrations.weights_digest import (
    AS_EXPECTED,
    buffer_digests,
    parameter_digests,
    shard_layouts,
)

_PLAIN = (bool, int, float, str)
# what the check compares, in the order its error looks for the first difference
KINDS = ("architecture", "layer specs", "settings", "parameters", "buffers", "shards")


def resolve_group(group, device: torch.device):
    """(group, rank, world size) the patch runs over; refuses a group that cannot carry the
    model's tensors."""
    initialized = dist.is_available() and dist.is_initialized()
    if group is None:
        if not initialized:
            return None, 0, 1
        group = dist.group.WORLD
    elif not initialized:
        raise ValueError(
            "patch_moe_epilogues: group was given but torch.distributed is not initialised"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("patch_moe_epilogues: group must contain this process, it does not")
    backend = str(dist.get_backend(group))
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"patch_moe_epilogues: group uses the nccl backend, which needs the model on a CUDA "
            f"device; the model is on {device}"
        )
    return group, rank, dist.get_world_size(group)


def _settings(model: torch.nn.Module, text_config) -> dict:
    """Every plain attribute of every module ({'model.layers.1.mlp.gate.topk_group': 1, ...}) and
    of the text config ('config.norm_topk_prob'); names starting with '_' are left out."""
    out = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if not attr.startswith("_") and (value is None or isinstance(value, _PLAIN)):
                out[f"{name}.{attr}" if name else attr] = value
    for key, value in sorted(text_config.to_dict().items()):
        if not key.startswith("_") and (value is None or isinstance(value, _PLAIN)):
            out[f"config.{key}"] = value
    return out


def fingerprint(
    model: torch.nn.Module, moe_indices: list[int], specs: Optional[dict] = None
) -> dict:
    """What must be equal on every rank, by kind (KINDS): {kind: {name: value}}. specs: {layer
    index: the EpilogueSpec its bridge is built with}."""
    text_config = model.config.get_text_config()
    return {
        "architecture": {
            "model_type": model.config.model_type,
            "hidden_size": text_config.hidden_size,
            "moe_layers": tuple(moe_indices),
        },
        "layer specs": {
            f"layer {i}.{f.name}": repr(getattr(spec, f.name))
            for i, spec in (specs or {}).items()
            for f in dataclasses.fields(EpilogueSpec)
        },
        "settings": _settings(model, text_config),
        "parameters": parameter_digests(model),
        "buffers": buffer_digests(model),
        "shards": shard_layouts(model),
    }


def first_difference(mine: dict, theirs: dict) -> Optional[tuple[str, list[str], str]]:
    """(kind, the differing names, the first one with both values) where `theirs` differs from
    `mine` (rank 0's), looking kind by kind in KINDS' order; None when they are equal."""
    for kind in KINDS:
        a, b = mine.get(kind, {}), theirs.get(kind, {})
        names = [k for k in dict.fromkeys([*a, *b]) if a.get(k, "<absent>") != b.get(k, "<absent>")]
        if names:
            first = names[0]
            if kind in ("parameters", "buffers"):
                shown = f"{first}: other values"
            else:
                shown = f"{first}: {a.get(first, '<absent>')!r} on rank 0, "
                shown += f"{b.get(first, '<absent>')!r} on the other"
            return kind, names, shown
    return None


def agree_on_model(
    model: torch.nn.Module,
    moe_indices: list[int],
    group,
    rank: int,
    specs: Optional[dict] = None,
    build_timeout_s: Optional[float] = None,
) -> None:
    """Every rank checks in (bounded by build_timeout_s), then every rank raises the same
    ValueError if the ranks hold different models or would build different bridges, naming the
    first rank that differs from rank 0 and its first difference."""
    check_in(group, timeout_s=build_timeout_s, label="patch_moe_epilogues (the model check)")
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, fingerprint(model, moe_indices, specs), group=group)
    compare_ranks(everyone)


def compare_ranks(everyone: list[dict]) -> None:
    """Raise the model check's ValueError when any rank's fingerprint (in rank order) differs
    from rank 0's, naming the first such rank and its first difference. Pure: every rank runs it
    on the same gathered list, so every rank raises the same error."""
    for rank, mine in enumerate(everyone):  # a shard its placements do not give the rank
        wrong = {k: v for k, v in mine.get("shards", {}).items() if not v.endswith(AS_EXPECTED)}
        if wrong:
            name, what = next(iter(wrong.items()))
            raise ValueError(
                "patch_moe_epilogues: every sharded parameter must hold on each rank the shard "
                f"its DTensor placements give that rank; on rank {rank}, {len(wrong)} do not "
                f"(first: {name}: {what})"
            )
    first = everyone[0]
    for other_rank, other in enumerate(everyone[1:], start=1):
        found = first_difference(first, other)
        if found is not None:
            kind, names, shown = found
            raise ValueError(
                "patch_moe_epilogues: every rank of the group must hold the same model and build "
                f"the same bridges; rank {other_rank} differs from rank 0 in {kind} {names[:3]}"
                + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                + f" (first: {shown.replace('the other', f'rank {other_rank}')})"
            )
