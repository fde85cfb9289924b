"""What counts as a score: a finite number (a bool counts as 1 or 0, a one-element numpy array
or torch tensor as its element). Shared by the Python reward worker and the HTTP reward;
standard library only."""

from __future__ import annotations

import math
import numbers
from typing import Any


class InvalidScore(ValueError):
    pass


def as_number(value: Any, what: str) -> float:
    """`value` as a float; InvalidScore naming `what` otherwise."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError):
            pass
    if not isinstance(value, numbers.Real):
        raise InvalidScore(f"{what} is a {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidScore(f"{what} is {number}, not a finite number")
    return number
