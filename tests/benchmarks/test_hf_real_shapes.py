"""benchmarks/hf_real_shapes.py: the real shapes hf_end_to_end.py times, checked without a GPU.

- Every row of the patch's family table has a family in REAL, and REAL covers exactly the CPU
  tests' builders (migration/examples/hf_moe_models.FAMILIES), so a new row cannot be left out of
  the GPU table.
- Each family this transformers has and the patch takes builds at its real shape on the meta
  device (nothing allocated) with the routed experts cut to REAL's count, its hidden size and
  top-k as the spec says, at least two MoE layers of four, and four layers within the default
  weights budget (so the default run times four layers of every family).
- The on-device init (build) leaves every buffer as transformers' own init makes it (rotary
  frequencies, routing biases), ties the embeddings where it does, and draws every parameter
  (finite, not constant), on the CPU tests' tiny models.
- A row refused on CUDA is skipped there, with the row's reason.
"""

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.hf_real_shapes import REAL, build, config_for, parse, why_skipped  # noqa: E402
from benchmarks.hf_real_shapes import weights_gb  # noqa: E402
from fusion_bridge.integrations.hf_families import FAMILIES, family_of  # noqa: E402
from migration.examples.hf_moe_models import FAMILIES as BUILDERS  # noqa: E402
from migration.examples.hf_moe_models import available, build_model, TINY  # noqa: E402

TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")
DEFAULT_BUDGET_GB = 24.0  # hf_end_to_end.py --budget-gb's default


def test_every_family_of_the_patch_table_has_real_shapes():
    assert sorted(REAL) == sorted(BUILDERS)
    missing = [f.name for f in FAMILIES if not set(f.model_types + f.wrappers) & set(REAL)]
    assert not missing, f"family table rows with no family in hf_real_shapes.REAL: {missing}"


@pytest.mark.parametrize("family", sorted(REAL))
def test_real_shape_builds_on_meta_as_specified(family):
    why = why_skipped(family, torch.device("cpu"))
    if why is not None:  # the run skips it too
        pytest.skip(f"{family}: {why}")
    import transformers

    key, experts, spec = REAL[family]
    spec = parse(spec)
    config, class_name = config_for(family, 4, smoke=False)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    text_config = getattr(config, "text_config", None) or config
    assert text_config.hidden_size == spec["hidden_size"]
    assert model.get_input_embeddings().weight.shape[1] == spec["hidden_size"]
    blocks = [
        m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "down_proj")
    ]
    assert len(blocks) >= 2, f"{family}: {len(blocks)} MoE layers of 4"
    assert {b.experts.down_proj.shape[0] for b in blocks} == {experts}
    top_k = next(spec[k] for k in TOP_K_KEYS if k in spec)
    assert getattr(text_config, "num_experts_per_tok", None) == top_k  # hf_moe_bound.py reads it
    row, _ = family_of(model)
    assert row.top_k(blocks[0]) == top_k
    assert weights_gb(family, 4) <= DEFAULT_BUDGET_GB


@pytest.mark.parametrize("family", sorted(REAL))
def test_on_device_init_keeps_buffers_and_draws_every_parameter(family):
    why = why_skipped(family, torch.device("cpu"))
    if why is not None:  # the run never builds it (5.17's Aria wrapper config fails to build)
        pytest.skip(f"{family}: {why}")
    mine = build(family, 3, torch.device("cpu"), smoke=True)
    own = build_model(family, TINY)  # transformers' own init (then its norms randomised)
    buffers = dict(own.named_buffers())
    for name, b in mine.named_buffers():
        if name.endswith("e_score_correction_bias"):  # build_model randomises them
            continue
        theirs = buffers[name]  # build_model casts every buffer to bf16; build keeps fp32 ones
        assert torch.equal(b.to(theirs.dtype), theirs), f"{family}: buffer {name} differs"

    def tied(model):
        out = model.get_output_embeddings()
        return out is not None and out.weight is model.get_input_embeddings().weight

    assert tied(mine) == tied(own)
    for name, p in mine.named_parameters():
        assert torch.isfinite(p).all(), f"{family}: {name} has non-finite values"
        assert p.float().std() > 0 or p.numel() == 1, f"{family}: {name} was not drawn"


def test_a_row_refused_on_cuda_is_skipped_there_with_its_reason():
    refused = {f: getattr(f, "cuda_refusal", None) for f in FAMILIES}
    checked = 0
    for family in REAL:
        row = next((f for f in FAMILIES if family in f.model_types + f.wrappers), None)
        if row is None or refused[row] is None or not available(family):
            continue
        assert refused[row] in why_skipped(family, torch.device("cuda"))
        checked += 1
    if not checked:
        pytest.skip("no row of the family table is refused on CUDA now")
