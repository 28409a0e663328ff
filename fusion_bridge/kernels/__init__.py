"""`fusion_bridge.kernels`: our Triton kernels, which live in the repository's top-level `kernels/`
folder (the project's layout) and are imported under this name only.

From a source tree (the repository root on `sys.path`, or an editable install) this package's
`__path__` names that folder, so `fusion_bridge.kernels.tp1.launch` is `kernels/tp1/launch.py`.
A built wheel holds the folder's files here instead (pyproject's package-dir maps
`fusion_bridge.kernels` to `kernels/`, which has no `__init__.py`: a top-level `kernels/` package
would shadow Hugging Face's `kernels` package, which transformers imports), so a wheel never ships
this file.
"""

from pathlib import Path

_FOLDER = Path(__file__).resolve().parents[2] / "kernels"
if not (_FOLDER / "launch_cache.py").is_file():
    raise ImportError(
        f"fusion_bridge.kernels: the kernels folder {_FOLDER} is missing; this file belongs to "
        "a source tree (a wheel maps the folder into the package instead)"
    )
__path__ = [str(_FOLDER)]
