"""Dynamic per-token FP8 in `fused_tp1`'s split rows, on one GPU at real shapes: T in {1, 16, 64},
H in {7168, 4096, 2048, 2880} (2880: not a multiple of 256, its last chunk partial), the launcher's
own split config (the chunks' programs exchange their sums of squares, then the row's amax).

Bit for bit, with every output poisoned first:
- codes and the row's scale against the torch reference (quant_ref, on CPU) applied to the
  kernel's own norm_out;
- against the whole-row kernel's per-token output on the same inputs: residual_out everywhere, the
  codes and scale of every row whose norm_out is the whole rows' bit for bit (a GPU's chunk sums
  may round a row's norm by an ulp otherwise: that row is held to the reference alone), and
  norm_out within the strategy's error bound everywhere.
Rows at T >= 16: row 1 holds its largest magnitude in the row's last chunk, row 2 a NaN there only
(codes 0x7F, scale NaN in every chunk), row 3 is all zero; a second call at T=16 takes gamma +inf
in the last chunk and -inf in the first (scales +inf, finite elements +-0, infinite ones 0x7F).
Then the same split rows captured in a CUDA graph and replayed on fresh inputs. Skips without
CUDA."""

import pytest
import torch

from fusion_bridge.kernels.quant import row_block
from fusion_bridge.kernels.tp1.configs import Tp1Config, split_ok
from fusion_bridge.oracle import quant_ref
from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.spec import EpilogueSpec, QuantSpec
from tests.kernels.test_tp1 import _launch_with, whole_rows

pytestmark = pytest.mark.gpu
HIDDEN = (7168, 4096, 2048, 2880)
TOKENS = (1, 16, 64)


def _strategy(hidden: int):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (on a GPU machine: `python -m pytest -m gpu`)")
    from fusion_bridge.environment import detect
    from fusion_bridge.registry import strategy_class

    spec = EpilogueSpec(
        hidden_size=hidden, top_k=8, routed_scaling_factor=2.5, quant=QuantSpec.fp8_per_token()
    )
    dev = torch.device("cuda", 0)
    env = detect(device=dev)
    cls = strategy_class("fused_tp1")
    assert cls.not_supported_reasons(spec, env) == []
    strat = cls(spec, env, None, dev)
    strat.prepare()
    return strat, env


def _split_config(strat, tokens: int) -> Tp1Config:
    """The launcher's own config where it splits rows (132 SMs: every case here); on a GPU with
    fewer SMs, the first chunk width of the production's that still splits."""
    launcher, hidden = strat._launcher, strat.spec.hidden_size
    config = launcher.config_for(tokens)
    if split_ok(config, tokens, hidden, launcher.num_sms):
        return config
    for columns in (512, 1024, 2048, 4096):
        config = Tp1Config(columns, max(1, columns // 256))
        if split_ok(config, tokens, hidden, launcher.num_sms):
            return config
    pytest.skip(f"{launcher.num_sms} SMs split no row of H={hidden} at T={tokens}")


def _inputs(spec: EpilogueSpec, tokens: int, chunk: int, seed: int):
    inp = make_inputs(spec, tokens, seed=seed, device="cuda")
    hidden = spec.hidden_size
    last = hidden - 3  # in the row's last chunk
    assert last // chunk == (hidden - 1) // chunk and last >= chunk
    if tokens > 3:
        inp.residual[1, last] = 1e4
        inp.residual[2, last - 1] = float("nan")
        inp.residual[3] = 0
        inp.expanded_idx_to_permuted_idx[3] = -1
        if inp.shared_output is not None:
            inp.shared_output[3] = 0
    return inp


def _problems(spec, env, strat, whole, got, tag) -> list[str]:
    found = []
    codes, scales = quant_ref.quantize_fp8_per_token(got.norm_out.cpu())
    if not torch.equal(got.quant.view(torch.uint8).cpu(), codes.view(torch.uint8)):
        bad = (got.quant.view(torch.uint8).cpu() != codes.view(torch.uint8)).nonzero()[:4]
        found.append(f"{tag}: codes differ from the reference at {bad.tolist()}")
    if not torch.equal(got.scale.cpu().view(torch.int32), scales.view(torch.int32)):
        found.append(f"{tag}: scales differ from the reference")
    if not torch.equal(got.residual_out.view(torch.int16), whole.residual_out.view(torch.int16)):
        found.append(f"{tag}: residual_out differs from the whole rows'")
    for r in range(got.norm_out.shape[0]):
        if torch.equal(got.norm_out[r].view(torch.int16), whole.norm_out[r].view(torch.int16)):
            if not torch.equal(got.quant[r].view(torch.uint8), whole.quant[r].view(torch.uint8)):
                found.append(f"{tag}: row {r} codes differ from the whole rows'")
            if not torch.equal(got.scale[r].view(torch.int32), whole.scale[r].view(torch.int32)):
                found.append(f"{tag}: row {r} scale differs from the whole rows'")
    finite = torch.isfinite(whole.norm_out).all(dim=1)
    err = rel_err(got.norm_out[finite], whole.norm_out[finite])
    if err > strat.error_bound(spec, env):
        found.append(f"{tag}: norm_out off the whole rows' by {err:.3g}")
    return found


@pytest.mark.parametrize("hidden", HIDDEN)
def test_per_token_split_rows_bit_for_bit_on_the_gpu(hidden: int) -> None:
    strat, env = _strategy(hidden)
    spec = strat.spec
    problems = []
    for tokens in TOKENS:
        config = _split_config(strat, tokens)
        assert config.columns < row_block(hidden)
        inp = _inputs(spec, tokens, config.columns, seed=hidden + tokens)
        calls = [("rows", inp)]
        if tokens == 16:
            gamma = inp.gamma.clone()
            gamma[hidden - 2], gamma[1] = float("inf"), -float("inf")
            calls.append(("inf", inp._replace(gamma=gamma)))
        for label, call in calls:
            whole = _launch_with(strat, call, whole_rows(spec))
            got = _launch_with(strat, call, config)
            torch.cuda.synchronize()
            tag = f"H={hidden} T={tokens} {label} chunks of {config.columns}"
            problems += _problems(spec, env, strat, whole, got, tag)
            if label == "rows" and tokens > 3:
                assert got.norm_out[1].float().abs().nan_to_num(0.0).argmax() == hidden - 3, tag
                assert torch.isnan(got.scale[2]).all(), tag
                assert (got.quant[2].view(torch.uint8) == 0x7F).all(), tag
            if label == "inf":  # row 2 holds a NaN, row 3 the NaN of 0 * inf: scale NaN
                rows = [r for r in range(tokens) if r not in (2, 3)]
                assert (got.scale[rows, 0] == float("inf")).all(), (tag, got.scale[:, 0])
    assert strat._launcher.take_error() == 0  # no wait gave up
    assert not problems, problems


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_per_token_split_rows_replayed_in_a_cuda_graph() -> None:
    """H=7168, T in {1, 16, 64} captured in one CUDA graph (the layer's graph words: each replay's
    calls take the next epochs of the sums' and the amaxes' words alike), replayed on three sets
    of fresh inputs into poisoned outputs: every output bit for bit an eager call's on the same
    inputs (the same split config, the current stream's words), the codes and scales the
    reference's on the replay's own norm_out."""
    strat, env = _strategy(7168)
    spec, launcher = strat.spec, strat._launcher
    for tokens in TOKENS:
        if not split_ok(launcher.config_for(tokens), tokens, 7168, launcher.num_sms):
            pytest.skip(f"{launcher.num_sms} SMs: T={tokens} takes whole rows")
    statics = {t: _inputs(spec, t, 512, seed=t) for t in TOKENS}
    for inp in statics.values():
        strat.run(inp)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {t: strat.run(inp) for t, inp in statics.items()}
    problems = []
    for seed in (11, 12, 13):
        fresh = {t: _inputs(spec, t, 512, seed=seed + t) for t in TOKENS}
        for t, inp in fresh.items():
            for dst, src in zip(statics[t], inp):
                if dst is not None:
                    dst.copy_(src)
        for out in outs.values():
            for tensor in (out.residual_out, out.norm_out, out.quant, out.scale):
                _bits(tensor).fill_(0xFF)  # the replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        for t in TOKENS:
            want = strat.run(fresh[t])
            torch.cuda.synchronize()
            got, tag = outs[t], f"graph T={t} seed {seed}"
            for name in ("residual_out", "norm_out", "quant", "scale"):
                if not torch.equal(_bits(getattr(got, name)), _bits(getattr(want, name))):
                    problems.append(f"{tag}: {name} differs from the eager call's")
            codes, scales = quant_ref.quantize_fp8_per_token(got.norm_out.cpu())
            if not torch.equal(_bits(got.quant).cpu(), _bits(codes)):
                problems.append(f"{tag}: codes differ from the reference")
            if not torch.equal(got.scale.cpu().view(torch.int32), scales.view(torch.int32)):
                problems.append(f"{tag}: scales differ from the reference")
    assert launcher.take_error() == 0  # no wait gave up
    assert not problems, problems
