"""Each strategy's `partial_dtype()` is the dtype of the [T, H] partial its run() all-reduces.

A rank whose call failed before the collective takes part by all-reducing reserved NaN rows of
`partial_dtype()` (call/failure.take_part), while its peers all-reduce the partial their run()
makes. Another dtype there is another byte count: gloo aborts a peer, NCCL pairs the wrong bytes.
Here every CPU strategy runs at world size 2 with torch.distributed.all_reduce recorded instead of
made (one process, no group), so a wrong declaration fails an assertion naming the strategy.
"""

from __future__ import annotations

import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.environment import Environment
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.registry import strategy_class
from tests.helpers import cpu_strategy_names

SPEC = EpilogueSpec(hidden_size=64, top_k=2, dtype=torch.bfloat16, max_tokens=8)
TOKENS = 5


def test_what_run_all_reduces_is_a_partial_of_partial_dtype(monkeypatch):
    reduced = []
    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t, *a, **k: reduced.append((t.dtype, t.shape))
    )
    env = Environment(world_size=2, triton_interpret=True)
    declared = {}
    for name in cpu_strategy_names(world_size=2):
        strategy = strategy_class(name)(SPEC, env, None, torch.device("cpu"))
        strategy.prepare()
        try:
            dtype = strategy.partial_dtype()
            if dtype is None:  # its collective is inside its own kernels: nothing to compare
                continue
            declared[name] = dtype
            reduced.clear()
            strategy.run(make_inputs(SPEC, TOKENS, seed=3))
            assert reduced == [(dtype, torch.Size([TOKENS, SPEC.hidden_size]))], (name, reduced)
        finally:
            strategy.close()
    # the oracle all-reduces fp32 partials of bf16 activations: the one dtype that differs
    assert declared.get("reference") == torch.float32, declared
    assert declared.get("separate") == torch.bfloat16, declared
