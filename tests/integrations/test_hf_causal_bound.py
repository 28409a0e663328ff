"""The logits bound's token mixers (migration/examples/hf_causal.py's `mixer_term`) take the
largest input error over the positions a token's mixer output reads: measured on real tiny
transformers models (Qwen3-Next's gated DeltaNet and its gated attention, Mixtral's plain
attention), bf16, CPU, with only earlier positions' mixer input moved; and a generate's decode
steps continue the running maxima of the calls before them. About 10 s on 2 cores."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from migration.examples.hf_causal import mixer_term  # noqa: E402
from migration.examples.hf_moe_bound import U_BF16, Recorder, language_model  # noqa: E402
from migration.examples.hf_moe_models import TINY, build_model, why_skipped  # noqa: E402
from tests.integrations.hf_decode import decode_steps_and_one_forward  # noqa: E402

PROMPT = (2, 12)
FIRST_CLEAN = 6  # positions 0..5 of each sequence get a moved mixer input, 6..11 keep theirs
# The bound counts expected squared errors (quadrature), so measured errors are means over seeds,
# as in test_hf_delta_gain.py (one draw of a per-head scalar's error exceeded 32 draws' mean 8.6x)
SEEDS = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class _Stop(Exception):
    """Raised by the mixer's output hook: nothing after the mixer is needed."""


def _mixer_output(model, mixer, prompt, moved=None) -> torch.Tensor:
    """The mixer's output [B, S, H] in fp32 on `prompt`; moved: its input replaced by this one
    (the model's own dtype)."""
    got = []

    def replace(module, args, kwargs):
        if moved is None:
            return None
        if args:
            return (moved.to(args[0].dtype), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": moved.to(kwargs["hidden_states"].dtype)}

    def keep(module, args, kwargs, output):
        got.append((output[0] if isinstance(output, tuple) else output).float())
        raise _Stop

    handles = [
        mixer.register_forward_pre_hook(replace, with_kwargs=True),
        mixer.register_forward_hook(keep, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            model(prompt, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return got[0]


def _mixer_input(mixer, model, prompt) -> torch.Tensor:
    seen = []

    def keep(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handle = mixer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(prompt, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize(
    "family, layer, kind",
    [("qwen3_next", 0, "delta rule"), ("qwen3_next", 1, "gated attention"), ("mixtral", 0, "")],
)
def test_an_earlier_positions_input_error_reaches_a_later_positions_mixer_output(
    family, layer, kind
):
    # positions 6..11 keep their mixer input bit for bit, yet their mixer output moves (through
    # the state, the conv window, the keys and values of 0..5): the bound's mixer term there must
    # come from the earlier positions' input error (the causal maximum); the position's own input
    # error is 0 and gave a term of 0 before issue 47
    if why_skipped(family) is not None:
        pytest.skip(f"{family}: {why_skipped(family)}")
    model = build_model(family, TINY, seed=0)
    recorder = Recorder(model)
    mixer = Recorder._mixer(language_model(model).layers[layer])
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=torch.Generator().manual_seed(1))
    recorder.start()
    try:
        with torch.no_grad():
            model(prompt, use_cache=False)
    finally:
        recorder.remove()
    call = recorder.calls[0]
    # measured on an fp32 copy, fed the bf16 model's mixer input: no rounding inside, so the
    # error at positions 6..11 is what their mixer reads of 0..5, the paths the gain bounds (the
    # bf16 mixer's own roundings of differing values come on top: `rounds` for a delta rule)
    x = _mixer_input(mixer, model, prompt).float()
    model = copy.deepcopy(model).float()
    mixer = Recorder._mixer(language_model(model).layers[layer])
    out = _mixer_output(model, mixer, prompt, x)
    earlier = torch.arange(PROMPT[1]) < FIRST_CLEAN
    measured, eps_in = 0, 0
    for seed in range(SEEDS):
        g = torch.Generator().manual_seed(100 + seed)
        step = (2 * torch.rand(x.shape, generator=g) - 1) * U_BF16 * earlier[:, None]
        moved = x * (1 + step)
        new = _mixer_output(model, mixer, prompt, moved)
        e_in = ((moved.float() - x.float()).norm(dim=-1) / x.float().norm(dim=-1)) ** 2
        e_out = ((new - out).norm(dim=-1) / out.norm(dim=-1)) ** 2
        measured, eps_in = measured + e_out.reshape(-1) / SEEDS, eps_in + e_in.reshape(-1) / SEEDS
    later = ~earlier.repeat(PROMPT[0])
    assert bool((eps_in[later] == 0).all()) and bool((eps_in[~later] > 0).all())
    if layer in call["gain"]:  # a delta rule: the gain the bound takes, derived per token
        gain = call["gain"][layer][0]
    else:
        # attention: its MIXER_GAIN constant is exceeded by the fp32 paths measured here even
        # at positions 0..5, whose own input moved (issue 47, found with this test: up to 12 for
        # Qwen3-Next's gated attention against 2, 1.6 for Mixtral's against 1), which is not the
        # gap this test is about; so the gain is the one measured under the gains' own
        # assumption, one relative error over all positions <= t: the largest over 0..5
        gain = float((measured[~later] / eps_in[~later]).max())
        print(f"attention's measured A^2 {gain:.2f}, MIXER_GAIN {recorder.gains[layer]}")
    causal = mixer_term(eps_in, gain, 0, PROMPT)  # fp32: the paths alone
    own = mixer_term(eps_in, gain, 0, (eps_in.numel(), 1))  # each token its own sequence
    ratio = measured / causal
    print(
        f"{family} layer {layer} {kind}: later positions' measured output error "
        f"{float(measured[later].min()):.2e}..{float(measured[later].max()):.2e}, "
        f"over the causal term: worst {float(ratio[later].max()):.2f} there, "
        f"{float(ratio.max()):.2f} over all"
    )
    assert bool((measured[later] > 0).all()), measured
    assert bool((ratio <= 1).all()), ratio
    assert bool((own[later] < measured[later]).all()), own  # the old bound: this token's own eps


@pytest.mark.parametrize("family", ("qwen3_next", "mixtral"))
def test_a_generates_decode_steps_continue_the_running_maxima_of_the_calls_before(family):
    # generate with a KV cache: a prefill call, then one call per new token, each position's
    # mixers reading every position before it, the prompt's included; the bound of each decode
    # step (Recorder.bound on that call alone, as hf_moe.compare asks it) must equal the bound of
    # one forward over the same tokens. Measured: equal to the last bit (the models record the
    # same magnitudes on both paths; the delta-rule gains differ by at most 3.4e-7 relative);
    # 1e-3 leaves room for that only. Without the carry the decode steps' bounds come out 1.5 to
    # 4.4% (Qwen3-Next) and 0.45 to 1.2% (Mixtral) below the forward's.
    if why_skipped(family) is not None:
        pytest.skip(f"{family}: {why_skipped(family)}")
    model, recorder, steps, whole = decode_steps_and_one_forward(family)
    assert len(steps) == 5 and [c["shape"] for c in steps] == [(2, 8)] + [(2, 1)] * 4, steps
    for part in (0, 1):  # the final normed hidden state's bound, the logits'
        # last step first: its bound must find the maxima of the calls before it by itself
        stepwise = [recorder.bound(c, model, 1)[part].view(2, -1) for c in reversed(steps)]
        stepwise = torch.cat(stepwise[::-1], dim=1)
        once = recorder.bound(whole, model, 1)[part].view(2, -1)
        worst = float(((stepwise - once).abs() / once).max())
        print(f"{family} part {part}: worst relative difference {worst:.2e}")
        assert worst <= 1e-3, (part, stepwise, once)
