"""Issue 54 item 10, in one process: errors that name the argument, the variable or the cause."""

import pytest
import torch

from fusion_bridge import EpilogueInputError, EpilogueSpec, FusionBridge
from fusion_bridge.env_vars import EnvVarError
from fusion_bridge.oracle.synthetic import make_inputs

SPEC = EpilogueSpec(hidden_size=64, top_k=2)


@pytest.fixture(scope="module")
def bridge():
    with FusionBridge(SPEC, strategy="separate", self_test=False, tuning="off") as b:
        yield b


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda b: b.strategy_for(1.5), TypeError, "strategy_for: tokens must be an int"),
        (lambda b: b.explain(tokens=1.5), TypeError, "explain: tokens must be an int"),
        (
            lambda b: b.route_for("7"),
            TypeError,
            r"route_for: tokens must be an int \(the token count T\), got str '7'",
        ),
        (lambda b: b.route_for(True), TypeError, "got bool True"),
        (lambda b: b.strategy_for(-1), ValueError, "strategy_for: tokens must be >= 0, got -1"),
    ],
)
def test_a_token_count_that_is_not_one_is_named(bridge, call, error, text):
    with pytest.raises(error, match=text):
        call(bridge)


def test_integral_token_counts_of_other_types_are_taken(bridge):
    assert bridge.strategy_for(torch.tensor(3)) == bridge.strategy_for(3) == "separate"
    assert bridge.explain(tokens=torch.tensor(3)).to_dict()


def test_a_log_level_of_thousands_of_digits_names_the_variable(monkeypatch):
    from fusion_bridge import env_vars

    monkeypatch.setenv("FUSION_BRIDGE_LOG_LEVEL", "9" * 5000)
    with pytest.raises(EnvVarError, match="FUSION_BRIDGE_LOG_LEVEL must be") as caught:
        env_vars.check_all()
    assert "(5000 characters)" in str(caught.value) and len(str(caught.value)) < 500


@pytest.mark.parametrize("name", ["residual", "shared_output", "gemm2_out", "gamma"])
def test_a_zero_tensor_is_named_by_the_checks(name):
    from fusion_bridge.call.validation import validate_inputs

    inputs = make_inputs(SPEC, 3, seed=1)
    t = getattr(inputs, name)
    zero = torch._efficientzerotensor(t.shape, dtype=t.dtype)
    with pytest.raises(EpilogueInputError, match=f"{name} must be a tensor with storage"):
        validate_inputs(SPEC, inputs._replace(**{name: zero}), torch.device("cpu"))


def test_a_zero_tensor_that_reaches_a_kernel_is_named_not_an_invalid_storage():
    """Our Triton kernels read the data pointer: a zero tensor has none ("Attempted to access the
    data pointer on an invalid python storage"). The hot path does not look for zero tensors (a
    call per input); the failure path names the argument."""
    inputs = make_inputs(SPEC, 3, seed=1)
    zero = torch._efficientzerotensor(inputs.residual.shape, dtype=inputs.residual.dtype)
    with FusionBridge(SPEC, strategy="fused_tp1", self_test=False, tuning="off") as b:
        with pytest.raises(EpilogueInputError, match="residual must be a tensor with storage"):
            b(*inputs._replace(residual=zero))
        b(*inputs)  # and the next call runs
