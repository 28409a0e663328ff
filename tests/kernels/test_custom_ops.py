"""torch.library.opcheck on every custom op we register (kernels/ops.py, and the whole-epilogue op
of
fusion_bridge/call/custom_op.py): schema, fake (meta) implementation against the real one, autograd
registration, and AOT dispatch. Real outputs come from the Triton kernels (under the interpreter on
CPU). A new op must get a case: the last test fails when an op of the namespace has none."""

import pytest
import torch

import fusion_bridge.call.custom_op  # noqa: F401  (registers finalize_epilogue)
import fusion_bridge.kernels.ops  # noqa: F401  (registers the ops)
from fusion_bridge.kernels.quant import QUANT_FP8, QUANT_NONE, QUANT_NVFP4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _t(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _finalize_args(shared):
    perm = torch.tensor([[0, 3], [-1, 1], [2, -1]], dtype=torch.int32, device=DEVICE)
    return (
        _t(5, 64),
        perm,
        torch.rand(3, 2, generator=torch.Generator().manual_seed(1)).to(DEVICE),
        _t(3, 64, seed=2) if shared else None,
        2.5,
    )


def _norm_args(quant, swizzled, tokens=3):
    scale = {QUANT_NONE: 1.0, QUANT_FP8: 0.02, QUANT_NVFP4: 448.0}[quant]
    return (
        _t(tokens, 64),
        _t(tokens, 64, seed=1),
        _t(64, seed=2),
        1e-2,
        0.5,
        quant,
        scale,
        swizzled,
    )


CASES = [
    ("finalize_add", "shared", _finalize_args(True)),
    ("finalize_add", "no_shared", _finalize_args(False)),
    *[
        ("add_rmsnorm_quant", f"q{q}_{'swz' if s else 'lin'}", _norm_args(q, s))
        for q, s in [
            (QUANT_NONE, False),
            (QUANT_FP8, False),
            (QUANT_NVFP4, True),
            (QUANT_NVFP4, False),
        ]
    ],
    ("add_rmsnorm_quant", "nvfp4_zero_tokens", _norm_args(QUANT_NVFP4, True, tokens=0)),
    # dynamic FP8: (code, scale, swizzled, group, scale layout): per token group in the TMA
    # layout (a transposed scale view), per token
    (
        "add_rmsnorm_quant",
        "fp8_group_tma",
        (*_norm_args(QUANT_FP8, False)[:5], 3, 1.0, True, 16, 2),
    ),
    ("add_rmsnorm_quant", "fp8_token", (*_norm_args(QUANT_FP8, False)[:5], 4, 1.0, True, 0, 0)),
    *[
        (
            "quantize",
            f"q{q}_{'swz' if s else 'lin'}",
            (_t(3, 64), q, 0.02 if q == QUANT_FP8 else 448.0, s),
        )
        for q, s in [(QUANT_FP8, False), (QUANT_NVFP4, True), (QUANT_NVFP4, False)]
    ],
]


@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4", "fp8_group_tma", "fp8_token"])
def test_opcheck_whole_epilogue(quant):
    from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
    from fusion_bridge.call import custom_op
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(
        hidden_size=64,
        top_k=2,
        quant={
            "none": QuantSpec.none(),
            "fp8": QuantSpec.fp8(0.02),
            "nvfp4": QuantSpec.nvfp4(448.0),
            "fp8_group_tma": QuantSpec.fp8_per_token_group(16, "column_major_tma"),
            "fp8_token": QuantSpec.fp8_per_token(),
        }[quant],
    )
    with FusionBridge(spec) as bridge:
        name = next(k for k, v in custom_op._BRIDGES.items() if v is bridge)
        inp = make_inputs(spec, 3, device=DEVICE)
        torch.library.opcheck(torch.ops.fusion_bridge.finalize_epilogue.default, (*inp, name))


@pytest.mark.parametrize("op_name,label,args", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_opcheck(op_name, label, args):
    op = getattr(torch.ops.fusion_bridge, op_name).default
    torch.library.opcheck(op, args)


def test_every_registered_op_has_a_case():
    registered = {
        name
        for name in dir(torch.ops.fusion_bridge)
        if isinstance(getattr(torch.ops.fusion_bridge, name), torch._ops.OpOverloadPacket)
    }
    assert registered and registered == {c[0] for c in CASES} | {"finalize_epilogue"}, registered


@pytest.mark.parametrize("quant", [QUANT_NONE, QUANT_FP8, QUANT_NVFP4])
def test_the_eager_path_computes_what_the_op_computes_and_allocates_only_its_outputs(quant):
    from fusion_bridge.kernels import ops

    g = torch.Generator().manual_seed(quant)
    residual, reduced = (
        torch.randn(5, 64, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2)
    )
    gamma = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16).to(DEVICE)
    args = (
        residual,
        reduced,
        gamma,
        1e-6,
        0.25,
        quant,
        0.05 if quant == QUANT_FP8 else 300.0,
        True,
    )
    eager = ops.direct_when_eager.add_rmsnorm_quant(*args)
    op = torch.ops.fusion_bridge.add_rmsnorm_quant(*args)
    assert torch.equal(eager[0], op[0]) and torch.equal(eager[1], op[1])
    if quant == QUANT_NONE:
        assert eager[2] is None and eager[3] is None
    else:
        assert torch.equal(eager[2].view(torch.uint8), op[2].view(torch.uint8))
        assert (eager[3] is None) == (quant == QUANT_FP8)
        if quant == QUANT_NVFP4:
            assert torch.equal(eager[3], op[3])
