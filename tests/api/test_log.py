"""fusion_bridge.log: the library logger's handlers and level (FUSION_BRIDGE_LOG_LEVEL, the
application's
own logging config), the rate-limited helper and the one summary line per bridge."""

import io
import logging
import os
import subprocess
import sys

import pytest

from fusion_bridge import log as fblog


@pytest.fixture
def clean_logger(monkeypatch):
    """The library logger as at import without the variable, restored afterwards."""
    lg = fblog.logger
    saved = (list(lg.handlers), lg.level, lg.propagate)
    fblog.configure({})
    yield lg
    fblog.configure({})
    lg.handlers[:] = saved[0]
    lg.setLevel(saved[1])
    lg.propagate = saved[2]


def no_root_handlers(monkeypatch):
    """An application that configured nothing (pytest adds its capture handlers to the root logger
    for
    each test phase, so this must run inside the test body)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def stream_handlers(lg):
    return [h for h in lg.handlers if not isinstance(h, logging.NullHandler)]


def test_library_logger_has_no_handler_of_its_own_by_default(clean_logger):
    # no NullHandler either: with no configuration, Python's last-resort handler shows WARNING+
    assert clean_logger.handlers == []
    assert (
        clean_logger.name == "fusion_bridge"
        and fblog.get_logger("bridge").name == "fusion_bridge.bridge"
    )
    # level left to the standard config: inherits the root logger's (WARNING unless configured)
    assert clean_logger.level == logging.NOTSET
    assert clean_logger.getEffectiveLevel() == logging.getLogger().getEffectiveLevel()


def test_env_level_adds_one_stderr_handler_when_the_application_configured_nothing(
    clean_logger, monkeypatch
):
    no_root_handlers(monkeypatch)
    out = io.StringIO()
    handler = fblog.configure({"FUSION_BRIDGE_LOG_LEVEL": "info"}, stream=out)
    assert handler is not None and stream_handlers(clean_logger) == [handler]
    assert clean_logger.level == logging.INFO and clean_logger.propagate is False
    fblog.get_logger("bridge").info("built %s", "bridge")
    fblog.get_logger("bridge").debug("not shown")
    assert "INFO fusion_bridge.bridge: built bridge" in out.getvalue()
    assert "not shown" not in out.getvalue()
    # a second call replaces the handler instead of adding another
    fblog.configure({"FUSION_BRIDGE_LOG_LEVEL": "DEBUG"}, stream=out)
    assert len(stream_handlers(clean_logger)) == 1 and clean_logger.level == logging.DEBUG
    fblog.configure({})
    assert stream_handlers(clean_logger) == [] and clean_logger.propagate is True


def test_env_level_adds_no_handler_when_the_application_configured_logging(
    clean_logger, monkeypatch
):
    app = io.StringIO()
    root_handler = logging.StreamHandler(app)
    monkeypatch.setattr(logging.getLogger(), "handlers", [root_handler])
    assert fblog.configure({"FUSION_BRIDGE_LOG_LEVEL": "20"}) is None
    assert stream_handlers(clean_logger) == [] and clean_logger.propagate is True
    assert clean_logger.level == logging.INFO
    fblog.logger.info("to the application's handler")
    assert "to the application's handler" in app.getvalue()


def test_invalid_level_is_ignored_with_a_warning_naming_the_variable(clean_logger, monkeypatch):
    no_root_handlers(monkeypatch)
    with pytest.warns(RuntimeWarning, match="FUSION_BRIDGE_LOG_LEVEL='loud'"):
        assert fblog.configure({"FUSION_BRIDGE_LOG_LEVEL": "loud"}) is None
    assert stream_handlers(clean_logger) == [] and clean_logger.level == logging.NOTSET


@pytest.mark.parametrize(
    "value,level",
    [
        ("DEBUG", 10),
        ("info", 20),
        (" Warning ", 30),
        ("error", 40),
        ("CRITICAL", 50),
        ("15", 15),
        ("verbose", None),
        ("", None),
    ],
)
def test_parse_level(value, level):
    assert fblog.parse_level(value) == level


def test_first_build_with_the_env_var_prints_to_stderr_and_without_it_prints_nothing():
    """The variable is read when the first bridge is built (never at import): a malformed value then
    fails the build naming the variable (tests/test_env_vars.py). One process imports the package
    (and FlashInfer, which the first build would) without the variable and forks twice: each child
    is a process whose first bridge is still to be built, one with the variable set, one without
    (one import for both instead of one each)."""
    code = (
        "import os, sys, traceback\n"
        "from fusion_bridge import FusionBridge, EpilogueSpec\n"
        "from fusion_bridge.environment import detect\n"
        "from fusion_bridge.log import logger\n"
        "detect()  # imports what the build probes (FlashInfer), once, before the fork\n"
        "for level in ('INFO', None):\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        status = 1\n"
        "        try:\n"
        "            os.close(r)\n"
        "            os.dup2(w, 2)\n"
        "            if level:\n"
        "                os.environ['FUSION_BRIDGE_LOG_LEVEL'] = level\n"
        "            FusionBridge(EpilogueSpec(hidden_size=64, top_k=2)).close()\n"
        "            logger.info('hello info'); logger.warning('hello warning')\n"
        "            status = 0\n"
        "        except BaseException:\n"
        "            traceback.print_exc()\n"
        "        finally:\n"
        "            sys.stderr.flush()\n"
        "            os._exit(status)\n"
        "    os.close(w)\n"
        "    with os.fdopen(r) as f:\n"
        "        err = f.read()\n"
        "    print(repr((os.waitpid(pid, 0)[1], err)))\n"
    )
    env = dict(os.environ)
    env.pop("FUSION_BRIDGE_LOG_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (on_status, on), (off_status, off) = (eval(line) for line in proc.stdout.splitlines())
    assert on_status == 0, on
    assert "INFO fusion_bridge: hello info" in on and "hello warning" in on
    assert off_status == 0, off
    # unconfigured: Python's defaults, WARNING and above on stderr, INFO hidden
    assert "hello warning" in off and "hello info" not in off


def test_once_logs_a_key_the_first_time_only(clean_logger, caplog):
    fblog.reset_rate_limits()
    with caplog.at_level(logging.WARNING, logger="fusion_bridge"):
        assert fblog.once("slow build", logging.WARNING, "compiling %s", "kernels")
        assert not fblog.once("slow build", logging.WARNING, "compiling %s", "again")
        assert fblog.once("other", logging.WARNING, "other step")
    assert [r.getMessage() for r in caplog.records if r.name == "fusion_bridge"] == [
        "compiling kernels",
        "other step",
    ]


def test_the_slow_build_notice_comes_before_gpu_builds_only():
    import torch

    from fusion_bridge.assembly.admission import slow_build_notice

    line = slow_build_notice(["local_fused_nccl"], torch.device("cuda", 0), True, 1)
    assert line.startswith("fusion_bridge: rank 1: preparing and self-testing local_fused_nccl.")
    assert "minutes" in line
    assert "self-testing" not in slow_build_notice(["x"], torch.device("cuda", 0), False, 0)
    assert slow_build_notice(["local_fused_nccl"], torch.device("cpu"), True, 0) is None
    assert slow_build_notice([], torch.device("cuda", 0), True, 0) is None


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_log_every_rate_limits_per_key_and_counts_what_it_suppressed(
    clean_logger, monkeypatch, caplog
):
    clock = Clock()
    monkeypatch.setattr(fblog, "_clock", clock)
    fblog.reset_rate_limits()
    clean_logger.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="fusion_bridge"):
        assert fblog.log_every("reroute", 60, logging.WARNING, "rerouted T=%d", 9000)
        clock.now += 10
        assert not fblog.log_every("reroute", 60, logging.WARNING, "rerouted T=%d", 9001)
        assert not fblog.log_every("reroute", 60, logging.WARNING, "rerouted T=%d", 9002)
        assert fblog.log_every("shadow", 60, logging.WARNING, "shadow diverged")  # another key
        clock.now += 51
        assert fblog.log_every("reroute", 60, logging.WARNING, "rerouted T=%d", 9003)
        clock.now += 61
        assert fblog.log_every("reroute", 60, logging.WARNING, "rerouted T=%d", 9004)
    messages = [r.getMessage() for r in caplog.records if r.name == "fusion_bridge"]
    assert messages == [
        "rerouted T=9000",
        "shadow diverged",
        "rerouted T=9003 (2 similar messages suppressed in the last 60 s)",
        "rerouted T=9004",
    ]


def test_log_every_skips_a_hidden_level_without_counting_it(clean_logger, monkeypatch, caplog):
    monkeypatch.setattr(fblog, "_clock", Clock())
    fblog.reset_rate_limits()
    clean_logger.setLevel(logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="fusion_bridge"):
        assert not fblog.log_every("k", 60, logging.DEBUG, "hidden")
        assert fblog.log_every("k", 60, logging.WARNING, "shown")
    assert [r.getMessage() for r in caplog.records if r.name == "fusion_bridge"] == ["shown"]


def test_summary_line_of_a_measured_plan():
    line = fblog.build_summary(
        7168,
        8,
        2,
        [
            (1, "local_fused"),
            (2, "local_fused"),
            (4, "flashinfer_fused"),
            (8, "flashinfer_fused"),
            (16, "local_fused"),
            (8192, "local_fused"),
        ],
        {
            "flashinfer_fused_fp4": [
                "quant_not_nvfp4",
                "flashinfer_fused_fp4_broken",
                "fp4_needs_sm100",
            ],
            "reference": ["never_auto", "never_auto"],
        },
        overflow="separate",
        dtype="bf16",
        source="measured",
    )
    assert line == (
        "fusion_bridge: layer epilogue H=7168 K=8 bf16 TP2 -> local_fused for T<=2, "
        "flashinfer_fused "
        "for 3<=T<=8, local_fused for 9<=T<=8192, separate for T>8192 [measured]; rejected: "
        "flashinfer_fused_fp4(quant_not_nvfp4, flashinfer_fused_fp4_broken, fp4_needs_sm100), "
        "reference(never_auto)"
    )


def test_summary_line_of_an_explicit_request_without_limit_and_of_one_that_raises():
    line = fblog.build_summary(
        256,
        4,
        1,
        [(1, "separate"), (2, "separate"), (4, "separate")],
        {},
        overflow="separate",
        label="model.layers.3.mlp",
        quant="nvfp4",
        requested="separate",
    )
    assert line == (
        "fusion_bridge: model.layers.3.mlp H=256 K=4 nvfp4 TP1 -> separate for every T "
        "(requested separate); rejected: none"
    )
    line = fblog.build_summary(
        7168,
        8,
        8,
        [(64, "flashinfer_fused"), (128, "flashinfer_fused")],
        {"separate": ["x"]},
        quant="none",
    )
    assert line == (
        "fusion_bridge: layer epilogue H=7168 K=8 TP8 -> flashinfer_fused for T<=128, T>128 "
        "raises; "
        "rejected: separate(x)"
    )
