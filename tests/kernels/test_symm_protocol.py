"""The shape of our kernel layer, checked mechanically: the protocol and sizing import no Triton, no
Python function in the product takes more than 12 positional parameters (Triton @jit kernels are
exempt) and no @triton.jit function more than 16 (records instead of walls; flags by keyword), the
test/benchmark hooks reach no production launcher or strategy, every kernel family has one launcher
with the same verbs, called with a call's records, and every family's kernels can take the launch
cache."""

import ast
import inspect
import pathlib
import re
import subprocess
import sys


from fusion_bridge.kernels.symm import (
    oneshot as symm_oneshot,
    protocol as symm_protocol,
    twoshot as symm_twoshot,
)
from fusion_bridge.kernels.symm.protocol import ONESHOT, TWOSHOT
from fusion_bridge.strategies.symm_fused_oneshot import SymmFusedOneshotStrategy
from fusion_bridge.strategies.symm_fused_twoshot import SymmFusedTwoshotStrategy

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = {"PHASES", "EMULATED", "phases", "emulated"}


def test_protocol_and_sizing_import_no_triton():
    code = (
        "import sys; import fusion_bridge.strategies.symm_workspace as sw; "
        "from fusion_bridge.spec import EpilogueSpec; "
        "from fusion_bridge.kernels.symm.protocol import TWOSHOT; "
        "sw.capacity(EpilogueSpec(hidden_size=7168, top_k=8), 2, TWOSHOT); "
        "sw.buffer_bytes(EpilogueSpec(hidden_size=7168, top_k=8), 2); "
        "print('triton' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False", out


def test_no_function_in_the_product_takes_more_than_12_positional_parameters():
    wide = []
    for root in ("fusion_bridge", "kernels"):
        for path in (ROOT / root).rglob("*.py"):
            if "kernels" in path.parts and root == "fusion_bridge":
                continue  # fusion_bridge/kernels/__init__.py only points at kernels/
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
                    count = len(node.args.posonlyargs) + len(node.args.args)
                    if count > 12 and not jit:
                        wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {count}")
    assert not wide, wide


def _jit_functions():
    """(path, function node, source lines) of every @triton.jit function in the product."""
    for root in ("fusion_bridge", "kernels"):
        for path in (ROOT / root).rglob("*.py"):
            if "kernels" in path.parts and root == "fusion_bridge":
                continue  # fusion_bridge/kernels/__init__.py only points at kernels/
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list
                ):
                    yield path, node, text.splitlines()


def test_no_jit_function_takes_more_than_16_parameters():
    """Our kernels take records (kernels/records.py), not walls of positional arguments: at most
    16 parameters per @triton.jit function, constexprs included."""
    wide = []
    for path, node, _ in _jit_functions():
        a = node.args
        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        if count > 16:
            wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {count}")
    assert not wide, wide


def test_no_flag_is_passed_by_position_inside_a_kernel():
    """Inside @triton.jit code a flag is passed by keyword (`LEAN=True`): no positional True /
    False, and no positional argument whose line comment names the parameter it stands for
    (`True,  # LEAN`, `HW_CVT,  # GPU_MUL_RN: on a GPU`)."""
    named_by_comment = re.compile(r"#\s*[A-Z][A-Z0-9_]+\b(:|$)")
    found = []
    for path, node, lines in _jit_functions():
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            for arg in call.args:
                where = f"{path.relative_to(ROOT)}:{arg.lineno} {ast.unparse(call)[:60]}"
                if isinstance(arg, ast.Constant) and isinstance(arg.value, bool):
                    found.append(where)
                line = lines[arg.end_lineno - 1]
                comment = line[arg.end_col_offset :].partition("#")
                if comment[1] and named_by_comment.search("#" + comment[2]):
                    found.append(where)
    assert not found, found


def test_hooks_stay_out_of_production_launchers_and_strategies():
    verbs = ("__init__", "__call__", "bound", "config_for")
    for verb in verbs + ("variant_config",):
        method = getattr(symm_oneshot.OneshotLauncher, verb)
        assert not HOOKS & set(inspect.signature(method).parameters), verb
    assert not HOOKS & set(inspect.signature(symm_oneshot.call_args).parameters)
    # the kernel's hooks default to production
    params = inspect.signature(symm_oneshot.KERNEL.fn).parameters
    assert params["PHASES"].default == symm_protocol.ALL_PHASES
    assert params["EMULATED"].default is False
    # the two-shot (behind symm_fused_twoshot): its one hook, EMU, is the testing module's to set
    for verb in verbs:
        method = getattr(symm_twoshot.TwoshotLauncher, verb)
        assert not (HOOKS | {"EMU"}) & set(inspect.signature(method).parameters), verb
    for cls in (SymmFusedOneshotStrategy, SymmFusedTwoshotStrategy):
        # the call's own parameters only (`out`: the caller's preallocated outputs), no hook
        params = list(inspect.signature(cls.run).parameters)
        assert params == ["self", "inputs", "variant", "out"], params
    # no product module imports the rigs: test_no_product_module_imports_the_test_rigs
    # (tests/docs/test_layering.py)


def test_sizes_follow_the_layouts():
    assert ONESHOT.buffer_bytes(2, 16, 64, 2) == 256 + 3 * 2 * 16 * 64 * 2
    # the two-shot: 2 slots of [2][W][ceil(1024 / W)][H] (reduce-scatter, all-gather), any cap
    for cap in (1, 7, 4096, 100_000):
        assert TWOSHOT.buffer_bytes(3, cap, 64, 2) == 256 + 2 * 2 * 3 * 342 * 64 * 2


def test_capacity_at_every_world_size():
    """Tokens per call for DeepSeek-V3's H=7168 in bf16, at every supported world size, from the
    layouts in bytes: one-shot holds 3 slots of W x cap rows (at most 2048 tokens, within 512 MiB);
    the two-shot turns its fixed slots within a call, so it carries any T up to max_tokens."""
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.strategies import symm_workspace as sw

    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=8192)
    row = 7168 * 2
    budget = 512 << 20
    for world in range(2, 9):
        oneshot = min(2048, budget // (3 * world * row))  # 2048 up to W=6, 1783 at 7, 1560 at 8
        assert sw.capacity(spec, world, ONESHOT) == oneshot, world
        assert sw.capacity(spec, world, TWOSHOT) == 8192, world
    assert [sw.capacity(spec, w, ONESHOT) for w in (7, 8)] == [1783, 1560]
    # a max_tokens below the layout's bound is the capacity
    small = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=100)
    assert sw.capacity(small, 8, TWOSHOT) == sw.capacity(small, 8, ONESHOT) == 100
    big = EpilogueSpec(hidden_size=16384, top_k=8, max_tokens=65536)
    assert [sw.capacity(big, w, TWOSHOT) for w in (2, 4, 8)] == [65536] * 3


def test_the_twoshot_workspace_is_fixed_whatever_t():
    """symm_fused_twoshot's workspace does not depend on the tokens a call may carry and never
    makes the strategy refuse a T: no `workspace_too_small`, max_tokens_per_call == max_tokens.
    The whole workspace stays within 64 MB per rank at H=7168 in bf16 at every world size."""
    from fusion_bridge.environment import Environment
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.strategies import symm_workspace as sw

    env = Environment(device_type="cuda", sm=90, gpu_name="NVIDIA H200", triton_version="3.6.0")
    for world in range(2, 9):
        sizes = set()
        for max_tokens in (1, 256, 4096, 8192, 65536):
            spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=max_tokens)
            sizes.add(sw.buffer_bytes(spec, world, TWOSHOT))
            at_world = env.replace(world_size=world)
            assert SymmFusedTwoshotStrategy.max_tokens_per_call(spec, at_world) == max_tokens
            codes = [
                r.code for r in sw.reasons(spec, at_world, "t", probe=lambda: None, layout=TWOSHOT)
            ]
            assert codes == [], (world, max_tokens, codes)
        assert len(sizes) == 1, (world, sizes)
        (size,) = sizes
        assert size == symm_protocol.twoshot_buffer_bytes(world, 7168, 2), world
        assert size <= 64_000_000, (world, size)
    # 58.7 MB at W=2 (2 slots x 2 regions x 1024 rows of 7168 bf16 values)
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=4096)
    assert sw.buffer_bytes(spec, 2, TWOSHOT) == 256 + 2 * 2 * 1024 * 7168 * 2


def test_every_family_s_kernels_can_take_the_launch_cache():
    """The cached launcher (kernels/launch_cache.py) refuses a kernel whose source reaches
    module-level values (Triton re-checks them per launch): no kernel of the three families
    (`fused_tp1`'s whole and split rows, the one-shot, the two-shot's three) reaches one; their
    constants are attributes of a module (`protocol.SENTINEL_BITS`, `configs.MAX_POLLS`), which
    Triton folds. Compiled-mode JIT objects: a subprocess without the interpreter."""
    code = (
        "from fusion_bridge.kernels.tp1 import whole_rows as l, split_rows as s; "
        "from fusion_bridge.kernels.symm import oneshot as m, twoshot_kernels as t; "
        "kernels = (l._tp1_kernel, s._tp1_split_kernel, m._oneshot_kernel, t._finalize_kernel, "
        "t._rows_kernel, t._sync_kernel); "
        "[k.cache_key for k in kernels]; "
        "print(*[f'{k.fn.__name__}={sorted(n for n, _ in k.used_global_vals)}' for k in kernels])"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    names = ("_tp1_kernel", "_tp1_split_kernel", "_oneshot_kernel", "_finalize_kernel")
    names += ("_rows_kernel", "_sync_kernel")
    assert out.stdout.split() == [f"{name}=[]" for name in names], out.stdout


def test_the_twoshot_strategy_binds_its_workspace_to_its_launches(monkeypatch):
    """symm_fused_twoshot launches kernels/symm/twoshot (the two-shot pipeline, one launch config:
    the strategy declares the default variant only): its workspace's device state has the
    two-shot's shape (int64
    [TWOSHOT_STATE_WORDS]), and the layer bound from it (SymmLayer.bind, as prepare() does) with
    the records the strategy's run() passes gives launches on the bound pointers and state, at
    this group's world size. The launches are recorded, not made (the kernels use inline
    PTX,
    which the interpreter cannot run; tests/distributed/test_symm_twoshot_two_gpus.py launches
    them)."""
    from types import SimpleNamespace

    import torch

    from fusion_bridge.epilogue_tensors import allocate_outputs
    from fusion_bridge.kernels.records import RowOutputs, RowSource
    from fusion_bridge.kernels.symm.protocol import TWOSHOT_STATE_WORDS
    from fusion_bridge.kernels.symm.twoshot_kernels import _sync_kernel
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    assert SymmFusedTwoshotStrategy._launcher_class(None) is symm_twoshot.TwoshotLauncher
    assert SymmFusedTwoshotStrategy.variants(None, None) == ("default",)
    layout = SymmFusedTwoshotStrategy.workspace_layout
    words, dtype = layout.state_words, layout.state_dtype
    assert (words, dtype) == (TWOSHOT_STATE_WORDS, torch.int64)
    spec = EpilogueSpec(hidden_size=96, top_k=2)
    ws = SimpleNamespace(
        ptrs=torch.zeros(3, dtype=torch.int64),
        state=torch.zeros(words, dtype=dtype),
        buffer=torch.zeros(64, dtype=torch.uint8),  # this rank's buffer (its address is bound)
        world=2,
        rank=1,
        cap=spec.max_tokens,
        data_off=symm_protocol.HEADER_BYTES // 2,
        num_sms=132,
        timeout_ns=5_000_000_000,
    )
    layer = symm_protocol.SymmLayer.bind(ws, spec)
    inp = make_inputs(spec, 5, rank=1, seed=3)
    none = torch.empty(0, dtype=torch.uint8)
    made = []
    for name in ("_LAUNCH_F", "_LAUNCH_R", "_LAUNCH_S"):
        monkeypatch.setattr(
            symm_twoshot,
            name,
            lambda grid, args, consts, warps, n=name: made.append((n, args, consts)),
        )
    out = allocate_outputs(spec, 5, inp.residual.device)  # as the strategy's run() makes them
    symm_twoshot.TwoshotLauncher(layer)(RowSource.of(inp), RowOutputs.of(out, none))
    # one chunk at W = 2: the gate, F, X, R, Y, G and the final release
    assert [n for n, _, _ in made] == ["_LAUNCH_S", "_LAUNCH_F", "_LAUNCH_S", "_LAUNCH_R"] + [
        "_LAUNCH_S",
        "_LAUNCH_R",
        "_LAUNCH_S",
    ]
    assert all(args[0] is ws.ptrs for _, args, _ in made)
    # the row launches take this rank's buffer address, the others the device state
    own = ws.buffer.data_ptr()
    assert all(args[1] == own if n == "_LAUNCH_R" else args[1] is ws.state for n, args, _ in made)
    assert all(consts[0].WORLD == 2 for _, _, consts in made)  # PIPE, the call's Pipeline
    assert made[1][2][1].TOP_K == 2  # the finalize's FORM
    # the workspace's 5 s reach every sync launch in microseconds (the kernel multiplies its
    # `timeout` by 1000 into %globaltimer's nanoseconds): 5_000 would give up after 5 ms
    timeout_at = _sync_kernel.arg_names.index("timeout")
    assert layer.timeout_us == 5_000_000
    assert [args[timeout_at] for n, args, _ in made if n == "_LAUNCH_S"] == [5_000_000] * 4


def test_the_oneshot_launch_takes_the_workspace_timeout_in_microseconds():
    """The one-shot's kernel reads `timeout` in microseconds (it multiplies by 1000 into
    %globaltimer's nanoseconds): a workspace of 60 s (SymmWorkspace.timeout_ns, as create() sets
    it from FUSION_BRIDGE_SYMM_TIMEOUT_S) bound by SymmLayer.bind, as prepare() does, gives the
    launch 60_000_000. A unit slip of 1000 makes the kernels give up after 60 ms (a slow peer gets
    NaN and a rebuild) or wait 16 hours."""
    from types import SimpleNamespace

    import torch

    from fusion_bridge.epilogue_tensors import allocate_outputs
    from fusion_bridge.kernels.records import RowOutputs, RowSource
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.spec import EpilogueSpec

    layout = SymmFusedOneshotStrategy.workspace_layout
    spec = EpilogueSpec(hidden_size=128, top_k=2)
    ws = SimpleNamespace(
        ptrs=torch.zeros(3, dtype=torch.int64),
        state=torch.zeros(layout.state_words, dtype=layout.state_dtype),
        buffer=torch.zeros(64, dtype=torch.uint8),
        world=2,
        rank=0,
        cap=spec.max_tokens,
        data_off=symm_protocol.HEADER_BYTES // 2,
        num_sms=132,
        timeout_ns=60 * 10**9,
    )
    layer = symm_protocol.SymmLayer.bind(ws, spec)
    assert layer.timeout_us == 60_000_000
    inp = make_inputs(spec, 3, seed=5)
    out = allocate_outputs(spec, 3, inp.residual.device)
    none = torch.empty(0, dtype=torch.uint8)
    _, args, _, _ = symm_oneshot.call_args(layer, None, RowSource.of(inp), RowOutputs.of(out, none))
    params = [p for p in symm_oneshot._oneshot_kernel.arg_names if p.upper() != p]
    assert len(args) == len(params), params
    assert args[params.index("timeout")] == 60_000_000


def test_every_kernel_family_has_one_launcher_with_the_same_verbs():
    """`fused_tp1`, the one-shot and the two-shot: one launcher class each, with the verbs of
    `layer.FamilyLauncher` (a call with the records and an optional config, `config_for(tokens)`,
    `bound`) under the protocol's parameter names, and no other launch function beside it."""
    from fusion_bridge.kernels.layer import FamilyLauncher
    from fusion_bridge.kernels.tp1 import launcher as tp1_launcher

    launchers = (tp1_launcher.Tp1Launcher, symm_oneshot.OneshotLauncher)
    launchers += (symm_twoshot.TwoshotLauncher,)
    for cls in launchers:
        for verb in ("__call__", "config_for", "bound"):
            want = list(inspect.signature(getattr(FamilyLauncher, verb)).parameters)
            got = list(inspect.signature(getattr(cls, verb)).parameters)
            assert got == want, (cls.__name__, verb, got)
        for verb in ("__call__", "bound"):
            assert inspect.signature(getattr(cls, verb)).parameters["config"].default is None
    for module in (tp1_launcher, symm_oneshot, symm_twoshot):
        assert not hasattr(module, "launch"), module.__name__


def test_a_call_s_records_hold_its_tensors_as_the_kernels_name_them():
    """`RowSource.of(inputs)`: the six inputs under the kernels' names (a call without a shared
    output keeps None, and `for_kernel` puts the residual in its place); `RowOutputs.of`: the
    allocated outputs, FP8 codes viewed as uint8, the unused tensor where a quant mode has no
    codes or no scales."""
    import torch

    from fusion_bridge.epilogue_tensors import allocate_outputs
    from fusion_bridge.kernels.records import RowOutputs, RowSource
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.spec import EpilogueSpec, QuantSpec

    unused = torch.empty(0, dtype=torch.uint8)
    for quant in (QuantSpec.none(), QuantSpec.fp8(0.5), QuantSpec.nvfp4(336.0)):
        for shared in (True, False):
            spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant, has_shared_output=shared)
            inp = make_inputs(spec, 3, seed=1)
            src = RowSource.of(inp)
            want = (inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights)
            want += (inp.shared_output, inp.residual, inp.gamma)
            assert all(a is b for a, b in zip(src, want)) and len(src) == len(want)
            assert (src.shared is None) is not shared
            kernel_src = src.for_kernel()
            assert kernel_src.shared is (inp.shared_output if shared else inp.residual)
            assert kernel_src._replace(shared=None) == src._replace(shared=None)
            out = allocate_outputs(spec, 3, torch.device("cpu"))
            got = RowOutputs.of(out, unused)
            assert got.residual_out is out.residual_out and got.norm_out is out.norm_out
            kind = quant.kind.value
            if kind == "none":
                assert got.q is unused and got.sf is unused
            else:
                assert got.q.dtype == torch.uint8 and got.q.shape == out.quant.shape
                assert got.q.data_ptr() == out.quant.data_ptr()
                assert got.sf is (out.scale if kind == "nvfp4" else unused)
