"""Ship a tuned table as a default: copy a cache file written by `tune`/`bench` into
fusion_bridge/tuning/shipped/ under the name a bridge looks up (GPU name, world size and spec;
library versions not part of the key).

    python benchmarks/install_default_table.py ~/.cache/fusion_bridge/nvidia_h200_tp2_<hash>.json

Eager wall times (host-specific) are dropped; the shipped copy keeps the CUDA-graph times.
"""

import argparse
import json
import sys

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.environment import Environment
from fusion_bridge.spec import DTYPE_BY_NAME
from fusion_bridge.tuning.tables import default_table_path


def main(paths: list[str]) -> int:
    for path in paths:
        table = json.load(open(path))
        s = table["spec"]
        q = s["quant"]
        # the table key leaves the quant scales out (tuning.spec_key): any valid value will do
        quant = QuantSpec(
            q["kind"],
            scale=1.0 if q["kind"] == "fp8" else None,
            global_scale=1.0 if q["kind"] == "nvfp4" else None,
            sf_layout=q["sf_layout"],
        )
        spec = EpilogueSpec(
            hidden_size=s["hidden_size"],
            top_k=s["top_k"],
            dtype=DTYPE_BY_NAME[s["dtype"]],
            has_shared_output=s["has_shared_output"],
            quant=quant,
        )
        dest = default_table_path(
            spec,
            Environment(device_type="cuda", gpu_name=table["gpu"], world_size=table["world_size"]),
        )
        dest.parent.mkdir(exist_ok=True)
        # eager wall times belong to the host that measured them: a shipped table keeps graph times
        # only
        shipped = {k: v for k, v in table.items() if k not in ("eager_us", "path")}
        dest.write_text(json.dumps(shipped, indent=1, sort_keys=True))
        print(f"{path} -> {dest}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("paths", nargs="+", help="table files written by `tune` or `bench`")
    sys.exit(main(ap.parse_args().paths))
