"""Claims of the README's strategy table and of the report that a reader acts on, checked against
the code: a strategy said to run at "any world size" has no world-size limit in its capability
checks (beyond the sizes the compatibility matrix lists), and the report printed by
`bridge.explain()` in Python tells a Python user where the rest of the reasons are."""

import re
from pathlib import Path

from fusion_bridge import EpilogueSpec, FusionBridge, registry
from fusion_bridge.strategies import Environment

README = Path(__file__).resolve().parents[2] / "README.md"
GPU = Environment(device_type="cuda", sm=90, gpu_name="NVIDIA H200", world_size=1)


def _any_world_size_rows() -> list[str]:
    table = README.read_text().split("## Strategies")[1].split("\n\n")[1]
    names = [re.match(r"\| `(\w+)` \|", row) for row in table.splitlines()]
    return [
        m.group(1) for m, row in zip(names, table.splitlines()) if m and "any world size" in row
    ]


def test_strategies_said_to_run_at_any_world_size_have_no_limit():
    named = _any_world_size_rows()
    assert "local_fused_nccl" in named, named
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    classes = {c.name: c for c in registry.strategy_classes()}
    for name in named:
        for world in (1, 2, 3, 5, 8, 9, 16, 24, 64):
            codes = [
                r.code
                for r in classes[name].not_supported_reasons(spec, GPU.replace(world_size=world))
            ]
            assert not [c for c in codes if "world" in c], (name, world, codes)


def test_the_report_in_python_points_at_its_json_the_python_way():
    with FusionBridge(EpilogueSpec(hidden_size=64, top_k=2)) as bridge:
        text = str(bridge.explain())
    more = [line for line in text.splitlines() if "more for GPU machines" in line]
    assert more and all("`to_dict()` in Python" in line for line in more), more
