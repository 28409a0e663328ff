"""API drift: every FlashInfer name and parameter our strategies use exists in the installed
package.

Skipped only when flashinfer is not installed at all (`pip install -e ".[test]"` without the
flashinfer extra). An installed flashinfer that fails to import is a failure, not a skip: that is
the
broken install the capability checks would otherwise report only as "flashinfer_missing"."""

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("flashinfer") is None:
    pytest.skip(
        "flashinfer-python is not installed (the 'flashinfer' extra)", allow_module_level=True
    )

import flashinfer.comm as fi_comm  # noqa: E402  (a broken install fails here, loudly)

from fusion_bridge.strategies import flashinfer_common


def params(fn):
    return set(inspect.signature(fn).parameters)


def test_moe_finalize_fusion_takes_what_flashinfer_fused_passes():
    assert params(fi_comm.trtllm_moe_finalize_allreduce_fusion) >= {
        "allreduce_in",
        "residual_in",
        "norm_weight",
        "expanded_idx_to_permuted_idx",
        "norm_out",
        "residual_out",
        "quant_out",
        "scale_out",
        "workspace_ptrs",
        "launch_with_pdl",
        "world_rank",
        "world_size",
        "eps",
        "shared_expert_output",
        "expert_scale_factor",
        "routed_scaling_factor",
        "weight_bias",
    }


def test_allreduce_fusion_takes_what_the_ar_norm_subpath_passes():
    assert params(fi_comm.trtllm_allreduce_fusion) >= {
        "allreduce_in",
        "world_size",
        "world_rank",
        "token_num",
        "hidden_dim",
        "workspace_ptrs",
        "launch_with_pdl",
        "trigger_completion_at_end",
        "fp32_acc",
        "pattern_code",
        "use_oneshot",
        "allreduce_out",
        "residual_in",
        "residual_out",
        "norm_out",
        "quant_out",
        "scale_out",
        "rms_gamma",
        "rms_eps",
        "scale_factor",
        "layout_code",
        "weight_bias",
    }
    pattern = fi_comm.AllReduceFusionPattern
    assert (
        pattern.kARResidualRMSNorm,
        pattern.kARResidualRMSNormOutFP8Quant,
        pattern.kARResidualRMSNormOutFP4Quant,
        pattern.kMoEFinalizeARResidualRMSNorm,
    ) == (1, 4, 5, 7)
    assert fi_comm.QuantizationSFLayout.SWIZZLED_128x4 == 0


def test_workspace_class_and_limits_match():
    assert params(fi_comm.TRTLLMAllReduceFusionWorkspace.__init__) >= {
        "tp_size",
        "tp_rank",
        "max_token_num",
        "hidden_dim",
        "dtype",
        "group",
    }
    assert hasattr(fi_comm.TRTLLMAllReduceFusionWorkspace, "destroy")
    from flashinfer.comm import trtllm_ar

    assert trtllm_ar.MAX_COMM_SIZE == flashinfer_common.MAX_COMM_SIZE
    assert trtllm_ar.BarrierFlagCount == flashinfer_common.BARRIER_FLAG_COUNT
