"""The launch cache (kernels/launch_cache.py) on CPU: its key against Triton's own specialization,
the
keying and fallback logic with a fake compiled kernel and launcher (the interpreter has none), and
the
three kernels' outputs through the cached path under the interpreter, launched by a fake launcher
that
maps the positional arguments back onto the kernel's parameter names."""

from __future__ import annotations

import gc
import itertools
import weakref
from types import SimpleNamespace

import pytest
import torch

from fusion_bridge.kernels import add_rmsnorm, finalize_add, launch_cache as launcher, quant
from fusion_bridge.kernels import triton_launchers
from fusion_bridge.kernels.bound_launch import BoundLaunch
from fusion_bridge.kernels.launch_cache import KernelLauncher, Runtime, _make_key_fn
from fusion_bridge.kernels.records import RowOutputs, RowSource

STREAM = 1234


class Chain:
    """Stands for triton.knobs' HookChain."""

    def __init__(self):
        self.calls = []


def fake_runtime(device=0, stream=STREAM, version=(3, 6)):
    state = SimpleNamespace(device=device, stream=stream)
    knobs = SimpleNamespace(
        launch_enter_hook=Chain(),
        launch_exit_hook=Chain(),
        add_stages_inspection_hook=None,
        debug=False,
    )
    rt = Runtime(
        lambda: state.device,
        lambda dev: state.stream + dev,
        knobs,
        SimpleNamespace(instrumentation_mode="", fpsan_homomorphic_casts=False),
        version,
    )
    rt.state = state
    return rt


class FakeCudaLauncher:
    """CompiledKernel.run: records calls. With deep=True it also has CudaLauncher's `launch`."""

    def __init__(self, deep=False, fail=None):
        self.calls, self.launch_calls, self.fail = [], [], fail
        if deep:
            self.global_scratch_size = self.profile_scratch_size = 0
            self.launch_cooperative_grid, self.launch_pdl = False, False
            self.launch = lambda *a: self.launch_calls.append(a)

    def __call__(self, *args):
        if self.fail is not None:
            raise self.fail
        self.calls.append(args)


class FakeCompiled:
    def __init__(self, tag, launcher_=None, drop=()):
        self.function, self.packed_metadata = f"function{tag}", (4, 1, 0)
        self.run = launcher_ or FakeCudaLauncher()
        for name in drop:
            delattr(self, name)


class FakeKernel:
    """A JITFunction stand-in: kernel[grid](...) records the normal launch and returns a compiled
    kernel."""

    arg_names = ["x_ptr", "y_ptr", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self, make_compiled=None, fail=None):
        self.normal, self.used_global_vals, self.pre_run_hooks = [], {}, []
        self.compiled = []
        self.make_compiled = make_compiled or (lambda i: FakeCompiled(i))
        self.fail = fail

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.fail is not None:
                raise self.fail
            self.normal.append((grid, args, kwargs))
            compiled = self.make_compiled(len(self.normal))
            self.compiled.append(compiled)
            return compiled

        return launch


def make(kernel=None, **kw):
    kernel = kernel or FakeKernel()
    return kernel, KernelLauncher(
        kernel, ("BLOCK", "FLAG"), runtime=kw.pop("runtime", None) or fake_runtime(), **kw
    )


def tensors(dtype=torch.bfloat16):
    return torch.zeros(64, dtype=dtype), torch.zeros(64, dtype=dtype)


# ---- the key against Triton's own specialization
# ---------------------------------------------------------


def triton_spec(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_key_is_never_coarser_than_tritons_specialization():
    """Two arguments with one key must have one Triton specialization (else the cached kernel could
    be the wrong one); the converse need not hold (a finer key only costs an extra entry)."""
    ints = [
        0,
        1,
        2,
        3,
        5,
        15,
        16,
        17,
        32,
        1000,
        1024,
        7168,
        -1,
        -16,
        2**31 - 16,
        2**31 - 1,
        2**31,
        2**31 + 16,
        -(2**31),
        -(2**31) - 1,
        2**63 - 16,
        2**63,
    ]
    base = torch.zeros(64, dtype=torch.bfloat16)
    tens = [
        base,
        base[1:],
        base[8:],
        base[4:],  # 8 bytes in: 8- but not 16-byte aligned, the same dtype as `base`
        base[2:],
        torch.zeros(64, dtype=torch.float16),
        torch.zeros(64)[1:],
        torch.zeros(64, dtype=torch.uint8)[4:],
        torch.zeros(64, dtype=torch.uint8)[16:],
    ]
    scalar_key, tensor_key = _make_key_fn(("s",)), _make_key_fn(("t",))
    for kind, values, key in (
        ("int", ints + [0.5, 1.0, 16.0], scalar_key),
        ("tensor", tens, tensor_key),
    ):
        for a, b in itertools.combinations(values, 2):
            if key(0, False, "", 4, (), a) == key(0, False, "", 4, (), b):
                assert triton_spec(a) == triton_spec(b), f"{kind}: {a!r} and {b!r} share a key"


def test_token_counts_that_share_a_key_and_those_that_do_not():
    key = _make_key_fn(("s",))
    k = {t: key(0, False, "", 4, (), t) for t in (1, 3, 5, 16, 32, 64, 1000)}
    assert k[3] == k[5] == k[1000]  # 1000 % 16 == 8
    assert len({k[1], k[3], k[16]}) == 3  # 1 is a constexpr to Triton, 16 divisible by 16
    assert k[16] == k[32] == k[64]


def test_a_record_is_keyed_field_by_field_as_triton_specializes_it():
    """Two calls that differ in one field of a record (kernels/records.py: a tuple argument) get
    different keys exactly where Triton specializes the record differently (it would compile
    another kernel) and the same key where it does not: per field, each of a few values against
    the record's base value."""
    from fusion_bridge.kernels.records import LayerScalars
    from fusion_bridge.kernels.symm.protocol import OneshotSlots

    base = torch.zeros(64, dtype=torch.bfloat16)
    tensors = [torch.zeros(64, dtype=torch.bfloat16)[i * 8 :] for i in range(6)]
    src = RowSource(*tensors)
    other = {
        "same dtype, aligned": torch.zeros(32, dtype=torch.bfloat16),
        "one element in": base[1:],
        "8 bytes in": base[4:],
        "fp16": torch.zeros(64, dtype=torch.float16),
        "None": None,
    }
    cases = [(src, field, value) for field in src._fields for value in other.values()]
    slots = OneshotSlots(7168, 2048, 128)
    for field in slots._fields:
        cases += [(slots, field, v) for v in (4096, 16, 1, 7, 2**31, 2**31 + 16)]
    scalars = LayerScalars(2.5, 1e-6, 0.0, 1.0)
    for field in scalars._fields:
        cases += [(scalars, field, v) for v in (1.0, 0.0, -3.5, None)]
    outcomes = set()
    for record, field, value in cases:
        changed = record._replace(**{field: value})
        key = _make_key_fn(launcher._kinds((record,)))
        # another layout of the record (None for a tensor): the key function refuses it, so the
        # launcher takes the normal launch and never serves it from the cached entry
        same_layout = launcher._kinds((changed,)) == launcher._kinds((record,))
        same_key = same_layout and key(0, False, "", 4, (), record) == key(
            0, False, "", 4, (), changed
        )
        same_spec = triton_spec(record) == triton_spec(changed)
        assert same_key == same_spec, (type(record).__name__, field, value)
        outcomes.add(same_key)
    assert outcomes == {True, False}  # both kinds of change are among the cases


# ---- keying and fallback with a fake launcher
# --------------------------------------------------------------


def test_same_key_calls_the_cached_launcher_with_grid_stream_and_args():
    kernel, launch = make()
    x, y = tensors()
    launch((3, 7), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 1 and launch.entries == 1
    grid, args, kwargs = kernel.normal[0]
    assert (
        grid == (3, 7)
        and args == (x, y, 3, 0.5)
        and kwargs == {"BLOCK": 256, "FLAG": True, "num_warps": 4}
    )
    launch(
        (5, 7), (x, y, 5, 0.25), (256, True), 4
    )  # T=3 -> 5: same specialization; the grid changes
    assert len(kernel.normal) == 1
    run = kernel.compiled[0].run
    assert run.calls == [
        (5, 7, 1, STREAM, "function1", (4, 1, 0), None, None, None, x, y, 5, 0.25, 256, True)
    ]


def test_fixed_options_reach_the_normal_launch_and_the_cached_one_runs_its_kernel():
    """`options` (e.g. maxnreg) go to every normal launch; the cached path then launches the
    kernel that launch compiled with them, with the same positional arguments as without."""
    kernel, launch = make(options={"maxnreg": 64})
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 16)
    assert kernel.normal[0][2] == {"BLOCK": 256, "FLAG": True, "num_warps": 16, "maxnreg": 64}
    launch((4,), (x, y, 3, 0.5), (256, True), 16)
    assert len(kernel.normal) == 1
    run = kernel.compiled[0].run
    assert run.calls == [
        (4, 1, 1, STREAM, "function1", (4, 1, 0), None, None, None, x, y, 3, 0.5, 256, True)
    ]


def test_cached_launch_uses_the_current_stream_and_device():
    rt = fake_runtime()
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    rt.state.stream = 99
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert kernel.compiled[0].run.calls[-1][:4] == (3, 1, 1, 99)
    rt.state.device = 1  # another device: its own compiled kernel, so a normal launch first
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert kernel.compiled[1].run.calls[-1][3] == 100


def test_the_launcher_of_cudalauncher_is_called_directly_when_it_needs_no_scratch():
    kernel, launch = make(FakeKernel(lambda i: FakeCompiled(i, FakeCudaLauncher(deep=True))))
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    run = kernel.compiled[0].run
    assert run.calls == [] and run.launch_calls == [
        (
            3,
            1,
            1,
            STREAM,
            "function1",
            False,
            False,
            None,
            None,
            (4, 1, 0),
            None,
            None,
            None,
            x,
            y,
            3,
            0.5,
            256,
            True,
        )
    ]


@pytest.mark.parametrize(
    "change",
    [
        "misaligned",
        "eight_bytes_in",
        "dtype",
        "int_is_one",
        "int_div16",
        "int64",
        "float_for_int",
        "constexpr",
        "num_warps",
    ],
)
def test_a_key_change_launches_normally_then_caches_the_new_key(change):
    kernel, launch = make()
    x, y = tensors()
    call = [(x, y, 3, 0.5), (256, True), 4]
    launch((3,), *call)
    launch((3,), *call)
    assert len(kernel.normal) == 1
    if change == "misaligned":
        call[0] = (x[1:], y, 3, 0.5)  # a view one bf16 element in: not 16-byte aligned
    elif change == "eight_bytes_in":
        call[0] = (x[4:], y, 3, 0.5)  # four bf16 elements in: 8- but not 16-byte aligned
    elif change == "dtype":
        call[0] = (x.half(), y, 3, 0.5)
    elif change == "int_is_one":
        call[0] = (x, y, 1, 0.5)
    elif change == "int_div16":
        call[0] = (x, y, 16, 0.5)
    elif change == "int64":
        call[0] = (x, y, 2**31 + 3, 0.5)
    elif change == "float_for_int":
        call[0] = (x, y, 3.0, 0.5)
    elif change == "constexpr":
        call[1] = (512, True)
    else:
        call[2] = 8
    launch((3,), *call)
    assert len(kernel.normal) == 2, f"{change}: expected a normal launch"
    assert kernel.normal[1][1] == call[0]
    launch((3,), *call)
    assert len(kernel.normal) == 2 and len(kernel.compiled[1].run.calls) == 1
    launch((3,), (x, y, 3, 0.5), (256, True), 4)  # the first key is still cached
    assert len(kernel.normal) == 2 and len(kernel.compiled[0].run.calls) == 2


def _bound(rt=None, **kw):
    """A launcher and a BoundLaunch of it: grid (3,), constexprs (256, True), 4 warps, the
    trailing (n, scale) = (3, 0.5) bound; called with the two tensors."""
    kernel, launch = make(runtime=rt or fake_runtime(), **kw)
    return kernel, launch, BoundLaunch(launch, (3,), (256, True), 4, (3, 0.5))


def test_a_bound_launch_reaches_the_cached_launcher_with_its_bound_arguments():
    kernel, launch, bound = _bound()
    x, y = tensors()
    bound(x, y)  # the launcher's normal launch, then its entry kept by the bound launch too
    bound(x, y)
    bound(x, y)
    assert len(kernel.normal) == 1 and kernel.normal[0][1] == (x, y, 3, 0.5)
    # the second call through the launcher's own entry (the tensors), the third from the bound
    # launch's entry: each tensor as its address (Triton's launcher takes an int as given)
    head = (3, 1, 1, STREAM, "function1", (4, 1, 0), None, None, None)
    ptrs = (x.data_ptr(), y.data_ptr())
    through, own = (*head, x, y, 3, 0.5, 256, True), (*head, *ptrs, 3, 0.5, 256, True)
    assert kernel.compiled[0].run.calls == [through, own]
    launch((3,), (x, y, 3, 0.5), (256, True), 4)  # the same key through the launcher itself
    assert len(kernel.normal) == 1


@pytest.mark.parametrize("change", ["misaligned", "eight_bytes_in", "dtype", "device"])
def test_a_bound_launch_keys_each_tensor_and_the_device(change):
    """What changes between a bound launch's calls (a tensor's alignment or dtype, the current
    device) is in its key: a change launches through the launcher (normally: another kernel),
    never from the entry of the first key (mutant i50-bound-key-no-device)."""
    rt = fake_runtime()
    kernel, launch, bound = _bound(rt)
    x, y = tensors()
    bound(x, y)
    bound(x, y)
    assert len(kernel.normal) == 1
    lead = (x, y)
    if change == "misaligned":
        lead = (x[1:], y)
    elif change == "eight_bytes_in":
        lead = (x, y[4:])
    elif change == "dtype":
        lead = (x, y.half())
    else:
        rt.state.device = 1
    bound(*lead)
    assert len(kernel.normal) == 2, f"{change}: expected a normal launch"
    bound(*lead)
    assert len(kernel.normal) == 2 and len(kernel.compiled[1].run.calls) == 1
    if change == "device":
        rt.state.device = 0
    bound(x, y)  # the first key is still kept
    assert len(kernel.normal) == 2 and len(kernel.compiled[0].run.calls) == 2


def test_a_bound_launch_under_hooks_or_with_the_fast_path_off_launches_normally():
    rt = fake_runtime()
    kernel, launch, bound = _bound(rt)
    x, y = tensors()
    for _ in range(3):  # the second call launches from the launcher's entry and keeps it, the
        bound(x, y)  # third from the bound launch's own
    assert len(kernel.normal) == 1 and len(kernel.compiled[0].run.calls) == 2
    rt.runtime_knobs.launch_enter_hook.calls.append(print)  # e.g. a profiler's
    bound(x, y)
    assert len(kernel.normal) == 2  # Triton's own launch, which calls the hooks
    rt.runtime_knobs.launch_enter_hook.calls.clear()
    bound(x, y)
    assert len(kernel.normal) == 2
    launch._disable("switched off by the test")
    bound(x, y)
    bound(x, y)
    assert len(kernel.normal) == 4


def test_a_bound_launch_whose_cached_launcher_raises_falls_back_and_switches_off():
    kernel = FakeKernel(lambda i: FakeCompiled(i, FakeCudaLauncher(fail=TypeError("layout"))))
    _, launch, bound = _bound(kernel=kernel)
    x, y = tensors()
    bound(x, y)
    bound(x, y)  # the launcher's cached path raises in the launcher: normal launch, switched off
    bound(x, y)
    assert "layout" in launch.disabled_reason and len(kernel.normal) == 3


def _flat(args) -> list:
    return [x for a in args for x in (_flat(a) if isinstance(a, tuple) else [a])]


@pytest.mark.parametrize("version,deep", [((3, 6), False), ((3, 6), True), ((3, 9), True)])
def test_a_bound_launch_passes_each_tensor_of_its_records_as_its_address(version, deep):
    """A record's tensors reach the launch as their addresses, in order, this call's (the address
    is read per call), its None and scalar fields as given, whichever layout the launch takes
    (CudaLauncher.__call__, or the C launcher with its arguments spread or as one tuple); the key
    still tells a misaligned tensor apart (mutants i50-bound-launch-passes-tensors,
    i50-bound-address-key-no-alignment)."""

    def compiled(i):
        run = FakeCudaLauncher(deep=deep)
        if deep and version >= (3, 7):  # the shared C launcher's attributes: args as one tuple
            run.arg_annotations, run.kernel_signature = (), ()
        return FakeCompiled(i, run)

    made = FakeKernel(make_compiled=compiled)
    kernel, launch = make(made, runtime=fake_runtime(version=version))
    bound = BoundLaunch(launch, (3,), (256, True), 4, (3, 0.5))
    x, y = tensors()
    bound((x, None, 7), y)  # the normal launch
    bound((x, None, 7), y)  # through the launcher's entry: the bound launch keeps it
    run = kernel.compiled[-1].run
    for a, b in ((x, y), (x.clone(), y.clone()), (x[16:], y[8:])):
        bound((a, None, 7), b)
        args = _flat((run.launch_calls if deep else run.calls)[-1])
        assert not any(isinstance(v, torch.Tensor) for v in args), args
        want = [a.data_ptr(), None, 7, b.data_ptr(), 3, 0.5, 256, True]
        assert args[-len(want) :] == want, args
    assert len(kernel.normal) == 1  # one key: every tensor 16-byte aligned, same dtypes


def test_a_bound_launch_holds_no_tensor_among_its_bound_arguments():
    _, launch = make()
    x, _ = tensors()
    with pytest.raises(TypeError, match="fixed must hold no tensor"):
        BoundLaunch(launch, (3,), (256, True), 4, (x, 0.5))


def test_an_argument_of_another_kind_launches_normally():
    kernel, launch = make()
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (None, y, 3, 0.5), (256, True), 4)  # None where a tensor was
    launch((3,), (None, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3 and launch.entries == 1 and launch.disabled_reason is None


def test_registered_launch_hooks_take_the_normal_launch():
    rt = fake_runtime()
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    rt.runtime_knobs.launch_enter_hook.calls.append(print)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2
    rt.runtime_knobs.launch_enter_hook.calls.clear()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2


def test_debug_knob_is_part_of_the_key():
    rt = fake_runtime()
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    rt.runtime_knobs.debug = True
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2


def test_instrumentation_mode_is_part_of_the_key():
    """Triton's compile options include knobs.compilation.instrumentation_mode; a launch after it
    changes must compile/launch normally, never reuse the launcher of the other mode (mutant
    killed: the key ignoring it)."""
    rt = fake_runtime()
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 1  # cached
    rt.compilation_knobs.instrumentation_mode = "consan"
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2  # the new mode's launcher is cached in turn


def test_a_stages_inspection_hook_takes_the_normal_launch():
    """From Triton 3.7 a stages-inspection hook adds a field to Triton's key: while one is set,
    every launch is Triton's own, and nothing is cached under it."""
    rt = fake_runtime(version=(3, 9))
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    rt.runtime_knobs.add_stages_inspection_hook = lambda: ("key", "hash")
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3 and launch.entries == 1
    rt.runtime_knobs.add_stages_inspection_hook = None
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3


def test_fpsan_is_part_of_the_key_from_triton_3_9():
    """Triton 3.9's JITFunction.run adds knobs.compilation.fpsan_homomorphic_casts to its compile
    options: a change of it must launch normally (test_launch_cache_versions checks the list)."""
    rt = fake_runtime(version=(3, 9))
    kernel, launch = make(runtime=rt)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 1
    rt.compilation_knobs.fpsan_homomorphic_casts = True
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2


def test_an_entry_keeps_its_compiled_kernel_alive():
    """From Triton 3.9 a CompiledKernel unloads its module when it is collected: a cached launch
    function must never outlive it (were Triton's own cache dropped)."""
    kernel, launch = make()
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    compiled = weakref.ref(kernel.compiled[0])
    kernel.compiled.clear()
    gc.collect()
    assert compiled() is not None
    launch._entries.clear()
    gc.collect()
    assert compiled() is None


@pytest.mark.parametrize("missing", ["packed_metadata", "function", "run"])
def test_a_missing_internal_means_normal_launches_forever_without_error(missing):
    kernel, launch = make(FakeKernel(lambda i: FakeCompiled(i, drop=(missing,))))
    x, y = tensors()
    for _ in range(3):
        launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3 and launch.entries == 0
    assert missing in launch.disabled_reason


def test_no_compiled_kernel_returned_means_normal_launches_forever():
    kernel, launch = make(FakeKernel(lambda i: None))  # what the interpreter returns
    x, y = tensors()
    for _ in range(3):
        launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3 and "no compiled kernel" in launch.disabled_reason


def test_a_cached_launcher_that_raises_is_replaced_by_the_normal_launch():
    kernel, launch = make(
        FakeKernel(lambda i: FakeCompiled(i, FakeCudaLauncher(fail=TypeError("layout"))))
    )
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch(
        (3,), (x, y, 3, 0.5), (256, True), 4
    )  # fast path raises -> launched normally, switched off
    assert len(kernel.normal) == 2 and "layout" in launch.disabled_reason
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 3


def test_an_error_of_the_callers_own_propagates_and_keeps_the_cache():
    kernel, launch = make(
        FakeKernel(lambda i: FakeCompiled(i, FakeCudaLauncher(fail=ValueError("cpu tensor"))))
    )
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    kernel.fail = ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
    with pytest.raises(ValueError, match="Pointer argument"):
        launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert launch.disabled_reason is None and launch.entries == 1


def test_global_values_or_pre_run_hooks_switch_the_cache_off():
    kernel = FakeKernel()
    kernel.pre_run_hooks.append(print)
    kernel, launch = make(kernel)
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    launch((3,), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 2 and "pre-run hooks" in launch.disabled_reason


def test_the_cache_is_bounded():
    kernel, launch = make(max_entries=2)
    x, y = tensors()
    for n in (3, 16, 1, 3):  # three keys; the first is evicted by the third
        launch((3,), (x, y, n, 0.5), (256, True), 4)
    assert launch.entries == 2 and len(kernel.normal) == 4


def test_constexprs_must_be_the_trailing_parameters():
    launch = KernelLauncher(FakeKernel(), ("FLAG", "BLOCK"), runtime=fake_runtime())
    assert "trailing" in launch.disabled_reason
    x, y = tensors()
    launch((3,), (x, y, 3, 0.5), (True, 256), 4)  # still launches, normally
    assert launch.kernel.normal[0][2] == {"FLAG": True, "BLOCK": 256, "num_warps": 4}


# ---- the real Triton runtime on this machine
# ---------------------------------------------------------------


def test_real_runtime_is_off_under_the_interpreter_and_says_why():
    runtime, reason = launcher.triton_runtime()
    assert runtime is None and "TRITON_INTERPRET" in reason


def test_an_unported_triton_version_or_the_env_switch_turns_it_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else the interpreter is the reason
    monkeypatch.setattr(triton_launchers, "triton_version", lambda: (3, 10))
    assert "(3, 10) is not a version whose launcher layout is known" in launcher.triton_runtime()[1]
    monkeypatch.setenv(launcher.ENV_VAR, "0")
    assert launcher.triton_runtime()[1] == f"{launcher.ENV_VAR}=0"


def test_the_three_kernels_use_the_normal_launch_under_the_interpreter():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    finalize_add.finalize_add_into(
        torch.empty_like(x), x, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2), None, 1.0
    )
    assert "TRITON_INTERPRET" in finalize_add._LAUNCH.disabled_reason


def test_the_suites_interpreter_patch_skips_only_repeats_and_changes_no_bit():
    """tests/helpers.py's InterpreterPatchOncePerLaunch, which tests/conftest.py installs under the
    interpreter: on this Triton it is installed (a Triton whose interpreter differs from the one it
    was written against runs unpatched, and slower: this fails then, so the check is looked at
    again), it skips the repeated patching of helper calls, each launch leaves triton.language as
    it found it, and kernels whose helpers live in other modules (ours, and Triton's own
    tl.max / tl.sum) give the same bits with it off."""
    import triton.language as tl

    from fusion_bridge.kernels import ops
    from tests.helpers import patch_the_interpreter_once_per_launch

    interp = patch_the_interpreter_once_per_launch()
    assert interp.installed
    load, reduce = tl.load, tl.core.reduce
    g = torch.Generator().manual_seed(2)
    residual, reduced = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    gamma = torch.randn(64, generator=g).to(torch.bfloat16)
    gemm2_out = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    perm, weights = torch.tensor([[0, 3], [-1, 1], [2, 5]], dtype=torch.int32), torch.rand(3, 2)

    def run():
        return (
            ops.direct_when_eager.add_rmsnorm_quant(
                residual, reduced, gamma, 1e-6, 0.25, quant.QUANT_NVFP4, 300.0, False
            )
            + ops.direct_when_eager.quantize(residual, quant.QUANT_FP8, 0.05, False)
            + (torch.ops.fusion_bridge.finalize_add(gemm2_out, perm, weights, None, 2.5),)
        )

    skipped = interp.skipped
    on = run()
    assert interp.skipped > skipped and not interp.patched
    assert tl.load is load and tl.core.reduce is reduce
    interp.enabled = False
    try:
        off = run()
    finally:
        interp.enabled = True
    assert len(on) == len(off)
    for a, b in zip(on, off):
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- outputs through the cached path, under the interpreter
# ------------------------------------------------


class InterpreterBackedKernel:
    """Wraps a real (interpreted) kernel: the normal launch runs it and returns a fake compiled
    kernel
    whose launcher maps the positional arguments back onto the kernel's parameter names and runs it
    again. A wrong argument layout in the cached path gives wrong outputs or an error here."""

    def __init__(self, real):
        self.real, self.arg_names = real, real.arg_names
        self.used_global_vals, self.pre_run_hooks, self.cached_launches = {}, [], 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.real[grid](*args, **kwargs)
            compiled = FakeCompiled("x")
            compiled.run = self._launcher
            return compiled

        return launch

    def _launcher(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        assert (stream, launch_metadata, enter, exit_) == (STREAM, None, None, None)
        self.cached_launches += 1
        self.real[(gx, gy, gz)](**dict(zip(self.arg_names, args)))


@pytest.fixture
def cached(monkeypatch):
    """Replace a module's _LAUNCH by a fake-runtime cache over the same interpreted kernel."""

    def install(module, kernel_name, constexprs):
        wrapped = InterpreterBackedKernel(getattr(module, kernel_name))
        monkeypatch.setattr(
            module, "_LAUNCH", KernelLauncher(wrapped, constexprs, runtime=fake_runtime())
        )
        return wrapped

    return install


def test_finalize_add_outputs_identical_through_the_cache(cached):
    torch.manual_seed(0)
    P, H, K = 12, 80, 3
    g = torch.randn(P, H, dtype=torch.bfloat16)
    wrapped = cached(finalize_add, "_finalize_add_kernel", ("TOP_K", "HAS_SHARED", "BLOCK_H"))
    for tokens, shared in ((3, True), (5, True), (3, False)):
        perm = torch.randint(-1, P, (tokens, K), dtype=torch.int32)
        w, s = torch.rand(tokens, K), torch.randn(tokens, H, dtype=torch.bfloat16)
        expected = torch.empty(tokens, H, dtype=torch.bfloat16)
        block = finalize_add.block_h_for(H, tokens)
        finalize_add._finalize_add_kernel[(tokens, -(-H // block))](
            RowSource(g, perm, w, s if shared else expected, None, None),
            expected,
            H,
            0.75,
            TOP_K=K,
            HAS_SHARED=shared,
            BLOCK_H=block,
        )
        out = torch.full_like(expected, float("nan"))
        finalize_add.finalize_add_into(out, g, perm, w, s if shared else None, 0.75)
        assert torch.equal(out, expected)
    assert (
        wrapped.cached_launches == 1
    )  # (5, shared) reused (3, shared)'s key; (3, no shared) is new


@pytest.mark.parametrize(
    "quant_mode,swizzled",
    [
        (quant.QUANT_NONE, False),
        (quant.QUANT_FP8, False),
        (quant.QUANT_NVFP4, True),
        (quant.QUANT_NVFP4, False),
    ],
)
def test_add_rmsnorm_and_quantize_outputs_identical_through_the_cache(cached, quant_mode, swizzled):
    from fusion_bridge.epilogue_tensors import quant_buffers
    from fusion_bridge.spec import QuantKind, SFLayout

    torch.manual_seed(1)
    H = 64
    kind = {
        quant.QUANT_NONE: QuantKind.NONE,
        quant.QUANT_FP8: QuantKind.FP8,
        quant.QUANT_NVFP4: QuantKind.NVFP4,
    }
    layout = SFLayout.SWIZZLED_128x4 if swizzled else SFLayout.LINEAR
    # the production launcher's constexpr names (the dynamic FP8 kinds' GROUP and SCALE_LAYOUT too)
    norm_kernel = cached(add_rmsnorm, "_add_rmsnorm_kernel", add_rmsnorm._LAUNCH.constexpr_names)
    quant_kernel = cached(quant, "_quantize_kernel", ("QUANT", "SWIZZLED", "BLOCK", "HW_CVT"))
    scale = 2.0 if quant_mode == quant.QUANT_FP8 else 300.0

    def buffers(tokens):
        q, sf = quant_buffers(tokens, H, kind[quant_mode], layout, torch.device("cpu"))
        q = torch.zeros(0, dtype=torch.uint8) if q is None else q.view(torch.uint8)
        sf = torch.zeros(0, dtype=torch.uint8) if sf is None else sf
        return q.fill_(0xFF), sf.fill_(0xFF)  # poisoned, as the activations (NaN)

    # T=3 launches normally (`KernelLauncher._launch_normally`, the path every interpreted test of
    # these kernels takes: the real launch cache is off under the interpreter; the arguments it
    # passes: test_same_key_calls_the_cached_launcher_with_grid_stream_and_args) and fills the
    # cache; T=5 takes the cached launcher, whose outputs must be the direct launch's. Only that
    # one is compared (a swizzled NVFP4 launch is 128 interpreted programs, the padding rows').
    for tokens in (3, 5):
        residual, reduced = torch.randn(2, tokens, H, dtype=torch.bfloat16)
        gamma = torch.randn(H, dtype=torch.bfloat16)
        outs = []
        for through_cache in (False, True) if tokens == 5 else (True,):
            r_out = torch.full_like(residual, float("nan"))
            n_out = torch.full_like(residual, float("nan"))
            q, sf = buffers(tokens)
            q2, sf2 = buffers(tokens)
            if through_cache:
                add_rmsnorm.add_rmsnorm_into(
                    r_out,
                    n_out,
                    q,
                    sf,
                    residual,
                    reduced,
                    gamma,
                    eps=1e-6,
                    weight_bias=0.0,
                    quant=quant_mode,
                    quant_scale=scale,
                    swizzled=swizzled,
                )
                quant.quantize_into(q2, sf2, n_out, quant_mode, scale, swizzled)
            else:
                (cx, warps) = quant.row_launch_shape(H, quant_mode, swizzled, False)
                rows = quant.launch_rows(quant_mode, swizzled, tokens, sf)
                sf_cols = sf.shape[1] if quant_mode == quant.QUANT_NVFP4 else 0
                named = dict(zip(("QUANT", "SWIZZLED", "BLOCK", "HW_CVT"), cx))
                add_rmsnorm._add_rmsnorm_kernel[(rows,)](
                    residual,
                    reduced,
                    gamma,
                    RowOutputs(r_out, n_out, q, sf),
                    tokens,
                    H,
                    1e-6,
                    0.0,
                    scale,
                    sf_cols,
                    **named,
                )
                if quant_mode != quant.QUANT_NONE:
                    quant._quantize_kernel[(rows,)](
                        n_out, RowOutputs(None, None, q2, sf2), tokens, H, scale, sf_cols, **named
                    )
            outs.append((r_out, n_out, q, sf, q2, sf2))
        if tokens == 5:
            assert torch.isfinite(outs[0][0]).all() and torch.isfinite(outs[0][1]).all()
            for a, b in zip(*outs):  # bit for bit (NaN poison would compare unequal as values)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert norm_kernel.cached_launches == 1  # T=5 reused T=3's key
    assert quant_kernel.cached_launches == (1 if quant_mode != quant.QUANT_NONE else 0)


# ---- the host-cost benchmark (runs on the GPU machine): importable, nothing runs at import
# ----------------


def test_eager_cost_benchmark_imports_and_aggregates():
    import benchmarks.eager_cost as bench

    row = {
        "world_size": 2,
        "quant": "none",
        "tokens": 1,
        "route_graph": "",
        "route_eager": "",
        "notes": "",
    }
    rank0 = [
        dict(row, item="finalize_epilogue", us_wall=12.0, us_host=11.0),
        dict(row, item="strategy_run", us_wall=10.0, us_host=9.0),
        dict(row, item="fi_moe_finalize_public", us_wall=8.0, us_host=7.0),
        dict(row, item="graph_selected", us_wall=6.0, us_host=float("nan")),
    ]
    rank1 = [
        dict(r, us_wall=r["us_wall"] + (1.0 if r["item"] == "finalize_epilogue" else -1.0))
        for r in rank0
    ]
    merged = {r["item"]: r["us_wall"] for r in bench.max_over_ranks([rank0, rank1])}
    assert merged == {
        "finalize_epilogue": 13.0,
        "strategy_run": 10.0,
        "fi_moe_finalize_public": 8.0,
        "graph_selected": 6.0,
    }
    (line,) = bench.ratios(bench.max_over_ranks([rank0, rank1]))
    assert line["eager_vs_flashinfer_direct"] == 1.625 and line["bridge_overhead_us"] == 3.0


def test_eager_cost_checks_issue_50s_target_at_world_size_1():
    """finalize_epilogue against fused_tp1_kernel_cached of the same run, pass at <= 2x, miss
    above, per quant and T; world size 2 has no such line."""
    import benchmarks.eager_cost as bench
    from benchmarks.eager_breakdown import target_check

    def rows(world_size, quant, tokens, call, anchor):
        base = dict(world_size=world_size, quant=quant, tokens=tokens, us_host=0.0)
        return [
            dict(base, item="finalize_epilogue", us_wall=call),
            dict(base, item="fused_tp1_kernel_cached", us_wall=anchor),
        ]

    got = rows(1, "none", 1, 20.0, 10.0) + rows(1, "nvfp4", 64, 25.0, 10.0)
    got += [dict(rows(2, "none", 1, 30.0, 10.0)[0])]
    lines = target_check(bench.ratios(got))
    assert lines == [
        "target TP1 none T=1: finalize_epilogue / fused_tp1_kernel_cached = 2.00 (<= 2): pass",
        "target TP1 nvfp4 T=64: finalize_epilogue / fused_tp1_kernel_cached = 2.50 (<= 2): miss",
    ]
