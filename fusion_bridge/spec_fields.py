"""The checks every spec field goes through (spec.py's dataclasses): one error per bad value,
naming the field, the expected and the actual value, and the normalisation of what passes (ints to
int, reals to float, enum names to the enum), so a spec is the same JSON on every rank."""

from __future__ import annotations

import math
import numbers

# the reason a Blackwell-only quantization format is refused (no Hopper consumer to check it)
BLACKWELL_REFUSAL = (
    "UE8M0-packed scales and MXFP8 are Blackwell formats with no Hopper consumer to check them "
    "against; they are not supported"
)
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FP32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 number


def _require(ok: bool, name: str, expected: str, actual: object, show_type: bool = False) -> None:
    if not ok:
        kind = type(actual).__name__
        seen = (
            f"{actual!r} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"
            if show_type
            else repr(actual)
        )
        raise ValueError(f"EpilogueSpec: {name} must be {expected}, got {seen}")


def _int_field(name: str, value: object) -> int:
    """A positive int (any integral type but bool), as int."""
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    _require(is_int and value > 0, name, "a positive int", value, show_type=not is_int)
    return int(value)


def _real_field(
    name: str,
    value: object,
    expected: str,
    positive: bool = False,
    low: float = 0.0,
    high: float = FP32_MAX,
) -> float:
    """A real number (int or float, numpy's too; not bool, not str) finite in fp32, as float; at
    most `high`; >= `low` and > 0 when `positive`."""
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    try:
        as_float = float(value) if is_real else math.nan
    except OverflowError:  # an int too large for a float
        as_float = math.inf
    _require(
        math.isfinite(as_float)
        and abs(as_float) <= FP32_MAX
        and (not positive or (as_float > 0 and as_float >= low))
        and as_float <= high,
        name,
        expected,
        _shown(value, as_float),
        show_type=not is_real,
    )
    return as_float


class _Shown(str):
    """A value described in words in an error (its repr would be unreadable or refused)."""

    def __repr__(self) -> str:
        return str(self)


def _shown(value: object, as_float: float) -> object:
    """What an error shows for `value`: an int too large for a float by its size (its repr can be
    thousands of digits, or refused by Python beyond 4300)."""
    if isinstance(value, numbers.Integral) and math.isinf(as_float):
        return _Shown(f"an int of {int(value).bit_length()} bits (too large for a float)")
    return value


def _enum_field(name: str, enum_cls: type, value: object):
    """`value` as a member of `enum_cls` (a member or its string value); a value naming UE8M0 or
    MXFP8 is refused with the reason (`BLACKWELL_REFUSAL`)."""
    if isinstance(value, str) and any(w in value.lower() for w in ("ue8m0", "mxfp8", "e8m0")):
        raise ValueError(f"EpilogueSpec: {name} {value!r} is refused: {BLACKWELL_REFUSAL}")
    try:
        return enum_cls(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"EpilogueSpec: {name} must be one of "
            f"{', '.join(repr(m.value) for m in enum_cls)}, got {value!r}"
        ) from None
