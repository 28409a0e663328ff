"""The Python example of the README's "What it is" section runs as written, the way the README says
to start it: `torchrun --nproc-per-node 2 example.py`, a real torchrun on CPU (2 gloo ranks; the
script creates its own process group). Its outputs are right by value: residual_out and norm_out
against the formula written out here in fp32 (from every rank's inputs), the NVFP4 outputs decoded
here by hand (nibbles, e4m3 block scales, the swizzled 128x4 layout) and within half an e2m1 step of
norm_out. A few lines appended after the block only save each rank's tensors for these checks."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_bridge.cli.launch import free_port
from tests.helpers import once_per_run

README = Path(__file__).resolve().parents[2] / "README.md"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
KEEP = (
    "gemm2_out",
    "expanded_idx_to_permuted_idx",
    "expert_weights",
    "shared_output",
    "residual",
    "gamma",
)
# runs after the README's block (which has closed the bridge and destroyed the group): save what
# the checks below need, per rank
SAVE_RESULTS = f"""
import os as _os
_dir = _os.environ["README_EXAMPLE_OUT"]
torch.save(
    dict(
        {{name: globals()[name].cpu() for name in {KEEP!r}}},
        residual_out=out.residual_out.cpu(), norm_out=out.norm_out.cpu(),
        quant=out.quant.cpu(), scale=out.scale.cpu(),
        global_scale=global_scale, T=T, H=H, K=K,
    ),
    _os.path.join(_dir, "rank" + _os.environ["RANK"] + ".pt"),
)
"""


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## What it is\n") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in 'What it is', found {len(blocks)}"
    return blocks[0]


def torchrun() -> list[str]:
    """The venv's `torchrun` script (it is `python -m torch.distributed.run`)."""
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`torchrun --nproc-per-node 2 example.py` (with a free port: other test runs may share this
    host) from a clean environment: no process-group variables inherited from this process. Once
    per run (tests.helpers.once_per_run: xdist workers share it)."""
    return once_per_run(tmp_path_factory, "readme_example", _launch)


def _launch(tmp):
    (tmp / "example.py").write_text(readme_example() + SAVE_RESULTS)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(README_EXAMPLE_OUT=str(tmp), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = torchrun() + ["--nproc-per-node", "2", "--master-port", str(free_port()), "example.py"]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    return proc, ranks


@pytest.fixture(scope="module")
def ranks(launched):
    return launched[1]


def formula_fp32(ranks, routed_scaling_factor=2.5, eps=1e-6):
    """The epilogue written out here, in fp32: sum over ranks of (finalize + shared), + residual,
    RMSNorm."""
    reduced = 0
    for r in ranks:
        perm, w = r["expanded_idx_to_permuted_idx"].long(), r["expert_weights"].float()
        rows = r["gemm2_out"].float()[perm.clamp(min=0)]  # [T, K, H]
        weighted = torch.where((perm >= 0).unsqueeze(-1), rows * w.unsqueeze(-1), torch.zeros(()))
        reduced = reduced + weighted.sum(1) * routed_scaling_factor + r["shared_output"].float()
    residual_out = ranks[0]["residual"].float() + reduced
    rms = torch.sqrt((residual_out**2).mean(-1, keepdim=True) + eps)
    return residual_out, residual_out / rms * ranks[0]["gamma"].float()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_example_uses_only_the_model_author_imports():
    code = readme_example()
    imports = [line for line in code.splitlines() if "import" in line]
    assert imports == [
        "import os",
        "import torch",
        "import torch.distributed as dist",
        "from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec",
    ]


def test_inputs_are_what_the_readme_says(ranks):
    r = ranks[0]
    T, H, K = r["T"], r["H"], r["K"]
    assert r["expanded_idx_to_permuted_idx"].dtype is torch.int32 and r[
        "expanded_idx_to_permuted_idx"
    ].shape == (T, K)
    assert (r["expanded_idx_to_permuted_idx"] == -1).any()
    assert r["expert_weights"].dtype is torch.float32 and r["expert_weights"].shape == (T, K)
    assert r["gamma"].dtype is torch.bfloat16 and r["gamma"].shape == (H,)
    assert r["gemm2_out"].dtype is torch.bfloat16 and r["gemm2_out"].shape[1] == H
    for name in (
        "residual",
        "gamma",
        "expanded_idx_to_permuted_idx",
        "expert_weights",
    ):  # replicated
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    for name in ("gemm2_out", "shared_output"):  # per-rank partial sums
        assert not torch.equal(ranks[0][name], ranks[1][name]), name


def test_outputs_match_the_fp32_formula(ranks):
    residual_ref, norm_ref = formula_fp32(ranks)
    # separate runs on CPU: finalize output, shared add, one all-reduce hop, norm output = 4 bf16
    # roundings, plus the rounding of the output itself: sqrt(4 + 1) * 2^-8 norm-wise (docs/math.md)
    bound = math.sqrt(5) * 2.0**-8
    for r in ranks:
        assert (
            r["residual_out"].dtype is torch.bfloat16
            and r["residual_out"].shape == residual_ref.shape
        )
        assert rel(r["residual_out"], residual_ref) < bound
        assert rel(r["norm_out"], norm_ref) < bound
    for name in ("residual_out", "norm_out", "quant", "scale"):
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs across ranks"


def test_nvfp4_outputs_decode_to_norm_out(ranks):
    r = ranks[0]
    T, H, gs = r["T"], r["H"], r["global_scale"]
    nb = H // 16
    rows, cols = -(-T // 128) * 128, -(-nb // 4) * 4
    assert r["quant"].dtype is torch.uint8 and r["quant"].shape == (T, H // 2)
    assert r["scale"].dtype is torch.uint8 and r["scale"].shape == (rows, cols)
    # unswizzle by hand: offset = (m//128)*(K4*512) + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4
    flat, k4 = r["scale"].reshape(-1), cols // 4
    used = torch.zeros_like(flat, dtype=torch.bool)
    sf = torch.empty(T, nb)
    for m in range(T):
        for k in range(nb):
            off = (
                (m // 128) * (k4 * 512)
                + (k // 4) * 512
                + (m % 32) * 16
                + ((m % 128) // 32) * 4
                + k % 4
            )
            sf[m, k] = flat[off : off + 1].view(torch.float8_e4m3fn).float()
            used[off] = True
    assert (flat[~used] == 0).all(), "padding of the swizzled scales must be 0"
    codes = torch.stack([r["quant"] & 0xF, r["quant"] >> 4], dim=-1).reshape(
        T, H
    )  # low nibble first
    values = torch.where((codes & 8) != 0, -E2M1[(codes & 7).long()], E2M1[(codes & 7).long()])
    unit = (sf / gs).repeat_interleave(16, dim=1)  # sf_b / global_scale
    x = r["norm_out"].float()
    amax = x.reshape(T, nb, 16).abs().amax(-1)
    expected_sf = (gs * amax / 6).clamp(max=448).to(torch.float8_e4m3fn).float()
    assert torch.equal(sf, expected_sf), "block scale must be e4m3(global_scale * amax / 6)"
    # e2m1's widest gap is 2 units, so round-to-nearest is within 1 unit; a block whose scale
    # rounded
    # down saturates at 6 units, at most amax * 2^-4 (one e4m3 step) away, also under 1 unit
    err = (values * unit - x).abs()
    assert (err <= unit * 1.0001).all(), f"worst error {(err / unit).max().item():.3f} units"
    assert rel(values * unit, x) < 0.2


def test_explain_was_printed_once(launched):
    printed = launched[0].stdout
    assert printed.count("plan (") == 1, printed  # rank 0 prints, rank 1 does not
    assert "separate" in printed and "flashinfer_fused" in printed


def test_every_rank_checked_and_printed_its_outputs(launched, ranks):
    printed, r = launched[0].stdout, ranks[0]
    T, H = r["T"], r["H"]
    for rank in range(2):  # the example's own check passed (an assert), then its line
        assert (
            f"rank {rank}: residual_out ({T}, {H}) torch.bfloat16, rms(norm_out / gamma) "
            in printed
        ), printed
        assert f"quant ({T}, {H // 2}), scale {tuple(r['scale'].shape)}" in printed, printed
