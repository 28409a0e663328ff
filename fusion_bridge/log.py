"""Logging for fusion-bridge, the way libraries in this field do it (vLLM, PyTorch).

- Everything goes to the ``fusion_bridge`` logger (children: ``fusion_bridge.<module>``). The
  library adds no handler of its own, so the application's logging configuration decides what is
  shown: ``logging.getLogger("fusion_bridge").setLevel(logging.INFO)`` or a root handler at INFO
  shows the one summary line per bridge. Without any configuration Python's defaults apply:
  WARNING and above reach stderr (its last-resort handler), INFO does not. That is how the one
  "this build step can take minutes" line per process (``once``) stays visible in a plain script.
- ``FUSION_BRIDGE_LOG_LEVEL=DEBUG|INFO|WARNING|ERROR|CRITICAL`` (or a number) sets the level of the
  ``fusion_bridge`` logger. If the application has not configured logging (no handler on the root
  logger nor on ``fusion_bridge``), it also adds one stderr handler to ``fusion_bridge`` (and stops
  propagation, so a later root configuration does not print each line twice). If the application has
  configured logging, no handler is added and records flow to the application's handlers.
- ``log_every(key, seconds, level, msg)`` rate-limits messages that can fire per call (reroutes,
  shadow divergence): at most one per key per interval, with a count of what was suppressed.
- ``build_summary(...)`` renders the one INFO line a bridge logs when it is built.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from typing import Mapping, Optional, Sequence

LOGGER_NAME = "fusion_bridge"
ENV_VAR = "FUSION_BRIDGE_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger(LOGGER_NAME)

_stderr_handler: Optional[logging.Handler] = None


def get_logger(name: Optional[str] = None) -> logging.Logger:
    """The library logger, or its child ``fusion_bridge.<name>``."""
    return logger.getChild(name) if name else logger


def parse_level(value: str) -> Optional[int]:
    """'info' / 'INFO' / '20' -> 20; None when the value is not a level."""
    text = value.strip()
    if text.upper() in LEVELS:
        return getattr(logging, text.upper())
    try:
        return int(text)
    except ValueError:
        return None


def _application_configured_logging() -> bool:
    own = [
        h
        for h in logger.handlers
        if not isinstance(h, logging.NullHandler) and h is not _stderr_handler
    ]
    return bool(logging.getLogger().handlers or own)


def configure(
    environ: Optional[Mapping[str, str]] = None, stream=None
) -> Optional[logging.Handler]:
    """Apply FUSION_BRIDGE_LOG_LEVEL (configure_once() runs it at the first bridge build; call it
    again after changing the variable).

    Returns the stderr handler it installed, or None. Idempotent: a second call replaces, never
    duplicates, the handler of the first. An unset or empty variable leaves the logger to the
    application's configuration; an invalid one is ignored with a warning naming the variable."""
    global _stderr_handler
    environ = os.environ if environ is None else environ
    if _stderr_handler is not None:
        logger.removeHandler(_stderr_handler)
        logger.propagate = True
        _stderr_handler = None
    value = environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    level = parse_level(value)
    if level is None:
        warnings.warn(
            f"{ENV_VAR}={value!r} is not a log level (expected one of {', '.join(LEVELS)} or an "
            "integer); ignoring it",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    logger.setLevel(level)
    if _application_configured_logging():
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.propagate = False
    _stderr_handler = handler
    return handler


# ---------------------------------------------------------------- rate limiting
_clock = time.monotonic
_lock = threading.Lock()
_last: dict[
    object, list
] = {}  # key -> [time of the last emitted message, messages suppressed since]


def log_every(
    key: object,
    seconds: float,
    level: int,
    msg: str,
    *args: object,
    log: Optional[logging.Logger] = None,
) -> bool:
    """Log `msg % args` at `level`, at most once per `seconds` for `key`; True when it was emitted.

    Messages suppressed in between are counted and the next emitted one says how many there were.
    A level the logger does not show costs one `isEnabledFor` check and is not counted."""
    log = log or logger
    if not log.isEnabledFor(level):
        return False
    now = _clock()
    with _lock:
        state = _last.get(key)
        if state is not None and now - state[0] < seconds:
            state[1] += 1
            return False
        suppressed = state[1] if state is not None else 0
        _last[key] = [now, 0]
    if suppressed:
        msg = (
            f"{msg} ({suppressed} similar message{'s' if suppressed != 1 else ''} suppressed in "
            "the last "
            f"{seconds:g} s)"
        )
    log.log(level, msg, *args)
    return True


_said: set = set()


def once(key: object, level: int, msg: str, *args: object) -> bool:
    """Log `msg % args` the first time `key` is seen in this process; True when it was emitted."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    logger.log(level, msg, *args)
    return True


def reset_rate_limits() -> None:
    """Forget every key's history (tests)."""
    with _lock:
        _last.clear()
        _said.clear()


# ---------------------------------------------------------------- the per-bridge summary line
def _merge_buckets(buckets: Sequence[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """[(upper bound, name), ...] in order -> [(first T, last T, name)] with neighbours merged."""
    ranges: list[tuple[int, int, str]] = []
    low = 1
    for bound, name in buckets:
        if ranges and ranges[-1][2] == name:
            ranges[-1] = (ranges[-1][0], bound, name)
        else:
            ranges.append((low, bound, name))
        low = bound + 1
    return ranges


def build_summary(
    hidden_size: int,
    top_k: int,
    world_size: int,
    buckets: Sequence[tuple[int, str]],
    rejected: Mapping[str, Sequence[str]],
    *,
    overflow: Optional[str] = None,
    label: str = "layer epilogue",
    dtype: Optional[str] = None,
    quant: Optional[str] = None,
    requested: Optional[str] = None,
    source: Optional[str] = None,
) -> str:
    """The one INFO line a bridge logs when it is built, e.g. (wrapped here)

        fusion_bridge: layer epilogue H=7168 K=8 TP2 -> local_fused for T<=8192,
        separate for T>8192; rejected: flashinfer_fused(cuda_required, flashinfer_missing)

    buckets: the plan, [(largest T of the bucket, strategy)] in increasing T (neighbours that pick
    the same strategy are merged). rejected: strategy -> reason codes, for the strategies that
    cannot run (build it as {s.name: [r.code for r in s.reasons] for s in statuses if s.reasons}).
    overflow: the strategy for T above the last bucket (None: such a call raises). label names the
    layer; dtype ("bf16") and quant ("fp8", "nvfp4"; "none" is omitted) are added after K when
    given; requested marks an explicit strategy request; source says where the plan came from
    ("measured", ...).
    """
    shape = f"H={hidden_size} K={top_k}"
    if dtype:
        shape += f" {dtype}"
    if quant and quant != "none":
        shape += f" {quant}"
    ranges = _merge_buckets(buckets)
    last = buckets[-1][0] if buckets else 0
    open_ended = bool(
        overflow and ranges and ranges[-1][2] == overflow
    )  # the last bucket's pick goes on
    parts = []
    for i, (low, high, name) in enumerate(ranges):
        if open_ended and i == len(ranges) - 1:
            parts.append(f"{name} for every T" if low == 1 else f"{name} for T>={low}")
        else:
            parts.append(f"{name} for T<={high}" if low == 1 else f"{name} for {low}<=T<={high}")
    if not open_ended:
        parts.append(f"{overflow} for T>{last}" if overflow else f"T>{last} raises")
    plan = ", ".join(parts)
    if requested and requested != "auto":
        plan += f" (requested {requested})"
    if source:
        plan += f" [{source}]"
    if rejected:
        rej = ", ".join(
            f"{name}({', '.join(dict.fromkeys(codes)) or '?'})" for name, codes in rejected.items()
        )
    else:
        rej = "none"
    return f"fusion_bridge: {label} {shape} TP{world_size} -> {plan}; rejected: {rej}"


_configured_from_environment = False


def configure_once() -> None:
    """Apply FUSION_BRIDGE_LOG_LEVEL the first time a bridge is built (or the CLI starts); the
    variable is never read at import. Later calls do nothing (call configure() to re-apply)."""
    global _configured_from_environment
    if not _configured_from_environment:
        _configured_from_environment = True
        configure()
