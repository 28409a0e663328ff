"""Our top-level `kernels/` folder must never be found as a top-level package named `kernels`.

Hugging Face's `kernels` package (a dependency of transformers 5.25 and of SGLang) is imported by
transformers when a model class is imported. With the repository root on `sys.path` (`python -m
...`,
`python -m pytest`, the README's commands), a `kernels/__init__.py` there would win over the
installed package and transformers would fail with `cannot import name ... from 'kernels'`.
Our
folder has no `__init__.py`, so it is at most a namespace portion, which never wins over an
installed
regular package; the product reaches it as `fusion_bridge.kernels` (fusion_bridge/kernels/
__init__.py names the folder as its __path__).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import kernels, transformers
import fusion_bridge.kernels.quant
print(kernels.__file__)
transformers.DeepseekV3ForCausalLM  # imports the model class, which imports `kernels` on 5.25
print(fusion_bridge.kernels.quant.__file__)
"""


def test_hugging_face_kernels_wins_from_the_repository_root():
    version = importlib.metadata.version("kernels")  # in the test extras: CI always has it
    assert version.startswith("0.19."), f"tested with kernels 0.19.x, found {version}"
    run = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    kernels_file, ours = run.stdout.split()[-2:]
    assert not Path(kernels_file).resolve().is_relative_to(ROOT / "kernels"), (
        f"`import kernels` from the repository root found {kernels_file}, not Hugging Face's"
    )
    assert Path(ours).resolve() == ROOT / "kernels" / "quant.py"
