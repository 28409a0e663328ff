"""The FP8 part of the error bound (oracle/numerics.quant_error_bound) is half an e4m3 step, not a
whole one: codes one step off in every other element must fail the check the self-test, shadow
mode and `parity` apply."""

import torch

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.epilogue_tensors import EpilogueOutputs
from fusion_bridge.oracle.numerics import compare, failures, quant_error_bound
from fusion_bridge.oracle.quant_ref import quantize_fp8

NORM_BOUND = 2.0**-8  # a strategy's bf16 bound, as the self-test passes it


def _outputs(norm_out, quant):
    return EpilogueOutputs(norm_out.clone(), norm_out.clone(), quant, None)


def test_fp8_codes_one_step_off_in_every_other_element_fail():
    g = torch.Generator().manual_seed(3)
    spec = EpilogueSpec(hidden_size=512, top_k=2, quant=QuantSpec.fp8(0.02))
    norm_out = torch.randn(16, 512, generator=g).to(torch.bfloat16)
    right = quantize_fp8(norm_out, 0.02)
    ref = _outputs(norm_out, right)
    assert not failures(spec, compare(spec, ref, ref), ref, NORM_BOUND)  # exact codes pass
    codes = right.view(torch.uint8).clone()
    step = torch.zeros_like(codes)
    step.view(-1)[::2] = 1  # the next e4m3 magnitude (away from 0) in every other element
    finite = (codes & 0x7F) < 0x7E
    off = torch.where(finite, codes + step, codes).view(torch.float8_e4m3fn)
    got = _outputs(norm_out, off)
    errors = compare(spec, got, ref)
    assert errors["quant"][0] > quant_error_bound(spec, ref, NORM_BOUND)
    assert any(line.startswith("quant:") for line in failures(spec, errors, ref, NORM_BOUND))
