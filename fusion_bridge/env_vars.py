"""Every ``FUSION_BRIDGE_*`` environment variable: read, validated and documented here, only here.

Nothing reads a variable at import time. A bridge validates all of them when it is built, before its
first collective (`check_all`), so a malformed value is reported on the rank that has it, naming the
variable, the accepted values and what was found; its peers then stop at the bounded check-in.

The README's table of variables is generated from `VARIABLES` and a test keeps the two equal.
"""

from __future__ import annotations

import difflib
import logging
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

PREFIX = "FUSION_BRIDGE_"

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# Timeouts are whole milliseconds, at least 1. The ceiling keeps them far below what a store wait
# (timedelta) or an int32 count of milliseconds can hold, and a day is longer than any real wait.
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 86400.0


class EnvVarError(ValueError):
    """A FUSION_BRIDGE_* variable holds a value the library cannot use. `name` is the variable."""

    def __init__(self, name: str, expected: str, raw: str, unknown: bool = False) -> None:
        shown = repr(raw) if len(raw) <= 80 else f"{raw[:60]!r}... ({len(raw)} characters)"
        if unknown:  # the name is what is wrong, not the value
            message = (
                f"unknown environment variable {name} (set to {shown}): the name must be {expected}"
            )
        else:
            message = f"environment variable {name} must be {expected}, got {shown}"
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Variable:
    name: str
    expected: str  # what a valid value looks like, as shown in errors and in the README
    default: str  # shown in the README
    doc: str
    parse: Callable[[str, "Variable"], object]
    unset: object  # what read() returns when unset or blank (None: the reader applies its default)


def _flag(raw: str, var: Variable) -> bool:
    text = raw.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise EnvVarError(var.name, var.expected, raw)


def finite_float(value: object) -> Optional[float]:
    """`value` as a finite float when it is a real number (int, float, numpy scalar; not a bool or
    a string), else None. Never raises: an int too large for a float is None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        as_float = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return as_float if math.isfinite(as_float) else None


def timeout_ms(seconds: float, what: str) -> int:
    """Seconds -> whole milliseconds (rounded up, so a positive timeout never becomes 0, which the
    stores read as "wait forever"). Any real number type (numpy's too). Raises ValueError naming
    `what` outside [MIN_TIMEOUT_S, MAX_TIMEOUT_S] or when not a finite number."""
    value = finite_float(seconds)
    if value is None or not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{what} must be a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}], "
            f"got {str(seconds)[:60] if isinstance(seconds, int) else repr(seconds)}"
        )
    return max(1, math.ceil(value * 1000 - 1e-9))


# a plain decimal number in ASCII: digits, an optional fraction, an optional exponent; no sign, no
# underscores, no other script's digits, no padding but spaces and tabs around it
_DECIMAL = re.compile(r"[ \t]*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?[ \t]*")


def _seconds(raw: str, var: Variable) -> float:
    if not _DECIMAL.fullmatch(raw):
        raise EnvVarError(var.name, var.expected, raw)
    try:
        return timeout_ms(float(raw), var.name) / 1000
    except ValueError:
        raise EnvVarError(var.name, var.expected, raw) from None


def _log_level(raw: str, var: Variable) -> int:
    text = raw.strip()
    if text.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        return getattr(logging, text.upper())
    if text.isascii() and text.isdigit() and len(text) <= 2 and int(text) <= 50:
        return int(text)  # (the length first: int() of thousands of digits raises on its own)
    raise EnvVarError(var.name, var.expected, raw)


def _text(raw: str, var: Variable) -> str:
    text = raw.strip()
    if not text.isprintable() or len(text) > 4096:
        raise EnvVarError(var.name, var.expected, raw)
    return text


SHADOW_PATTERN = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<every>[1-9][0-9]{0,8}))?")


def _shadow(raw: str, var: Variable) -> str:
    """'name' or 'name:N' (N in ASCII digits, 1 .. 999999999); whether `name` is a strategy is
    checked where the registry is (call/shadow.py), naming this variable too."""
    text = raw.strip()
    if not SHADOW_PATTERN.fullmatch(text):
        raise EnvVarError(var.name, var.expected, raw)
    return text


def _directory(raw: str, var: Variable) -> str:
    """A path, with `~` expanded as a shell would."""
    return os.path.expanduser(_text(raw, var))


def _names(raw: str, var: Variable) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if not all(n.isidentifier() for n in names):
        raise EnvVarError(var.name, var.expected, raw)
    return names


_SECONDS = f"a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] in ASCII digits"
_FLAG = f"one of {', '.join(TRUE_WORDS + FALSE_WORDS)} (any case)"

VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "FUSION_BRIDGE_STRATEGY",
            "'auto' or a registered strategy name",
            "auto",
            "Overrides the `strategy` argument of every bridge (an explicit request: raises if "
            "that strategy cannot run, never falls back).",
            _text,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_EXCLUDE",
            "a comma-separated list of strategy names",
            "",
            "Keeps these strategies out of `auto` (reported as excluded by request).",
            _names,
            (),
        ),
        Variable(
            "FUSION_BRIDGE_DEBUG",
            _FLAG,
            "0",
            "Value checks at every call and one small collective agreeing on (ok, T, call number); "
            "syncs, so keep it off on the hot path and under CUDA graphs.",
            _flag,
            False,
        ),
        Variable(
            "FUSION_BRIDGE_SELF_TEST",
            _FLAG,
            "1",
            "Run each GPU strategy once against the oracle when a bridge is built.",
            _flag,
            True,
        ),
        Variable(
            "FUSION_BRIDGE_SHADOW",
            "'name' or 'name:N' (a registered strategy; N in 1..999999999, every N-th call)",
            "",
            "Shadow mode: run `name` beside the selected strategy and record the divergence.",
            _shadow,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_BUILD_TIMEOUT_S",
            _SECONDS,
            "600",
            "How long a bridge build waits for every rank to check in.",
            _seconds,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_SYMM_TIMEOUT_S",
            _SECONDS,
            "60",
            "How long our symmetric-memory kernels wait for a peer before they give up with an "
            "error (the bridge must then be rebuilt).",
            _seconds,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_LOG_LEVEL",
            "DEBUG, INFO, WARNING, ERROR, CRITICAL or a number 0-50",
            "(application's logging)",
            "Level of the `fusion_bridge` logger; adds a stderr handler if the application has "
            "configured no logging.",
            _log_level,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_CACHE_DIR",
            "a directory path (`~` expanded)",
            "~/.cache/fusion_bridge",
            "Where `tune` writes measured tables and bridges look for them.",
            _directory,
            None,
        ),
        Variable(
            "FUSION_BRIDGE_LAUNCH_CACHE",
            _FLAG,
            "1",
            "0 switches off the cached Triton launch path (every launch goes through Triton's own "
            "`kernel[grid]`).",
            _flag,
            True,
        ),
    )
}


def read(name: str, environ: Optional[Mapping[str, str]] = None):
    """The parsed value of variable `name` (its default when unset or blank). Raises EnvVarError
    naming the variable when the value is malformed, KeyError for a name not in VARIABLES."""
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return var.unset
    return var.parse(raw, var)


def check_all(environ: Optional[Mapping[str, str]] = None) -> None:
    """Validate every FUSION_BRIDGE_* variable that is set, and refuse unknown ones: a typo such as
    FUSION_BRIDGE_DEBG, or a name meant to be ours without the exact prefix (fusion_bridge_debug,
    FUSION-BRIDGE-DEBUG), would otherwise be ignored silently. Raises EnvVarError on the first bad
    one."""
    environ = os.environ if environ is None else environ
    for key in sorted(environ):
        if _looks_ours(key) and key not in VARIABLES:
            close = difflib.get_close_matches(_squeezed(key), list(_SQUEEZED), n=1)
            hint = f" (did you mean {_SQUEEZED[close[0]]}?)" if close else ""
            raise EnvVarError(
                key,
                f"one of the known variables {sorted(VARIABLES)}{hint}",
                environ[key],
                unknown=True,
            )
    for name in VARIABLES:
        read(name, environ)


def _squeezed(name: str) -> str:
    """A variable name upper-cased with everything but letters and digits dropped: what a name
    meant to be ours looks like whatever its case and separators."""
    return re.sub(r"[^A-Z0-9]", "", name.upper())


_SQUEEZED = {_squeezed(name): name for name in VARIABLES}


def _looks_ours(key: str) -> bool:
    """FUSION_BRIDGE_X, and the names meant to be (fusion_bridge_x, FUSION-BRIDGE-X, FUSIONBRIDGE_X,
    a stray space), which would otherwise be ignored silently."""
    return key.startswith(PREFIX) or _squeezed(key).startswith("FUSIONBRIDGE")


def markdown_table() -> str:
    """The README's table of variables (a test keeps the README equal to this)."""
    rows = ["| variable | accepted values | default | what it does |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        rows.append(f"| `{v.name}` | {v.expected} | {v.default} | {v.doc} |")
    return "\n".join(rows)
