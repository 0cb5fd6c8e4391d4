"""The estimator's arguments: what each allows (``ArgumentValueError`` names the one that does not), and the readers of
the sizes a person writes (``"7B"`` parameters, ``"80GB"`` of memory).

Example::

    devices = parse_argument("memory_per_device", parse_bytes, "80GB")
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # as Lightning reads them
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_COUNT = 2**53  # the largest count whose byte arithmetic (floats) stays exact
MAX_WORLD_SIZE = 2**31 - 1  # torch.distributed's largest world size (a C int)
ELEMENT_SIZES = (1, 2, 4, 8)  # bytes per element of the dtypes (float8 ... float64)


class ArgumentValueError(ValueError):
    """A value that an argument does not allow: ``argument`` names it as the function's parameter, and
    ``requirement`` says what is allowed (the message is ``"<argument> <requirement>"`` unless given), so that the
    command line can say the same of its flag (``argument --bandwidth: must be positive (GB/s), got -1.0``).

    Example::

        raise ArgumentValueError("devices", f"must be an integer >= 1, got {devices!r}")
    """

    def __init__(self, argument: str, requirement: str, message: str | None = None) -> None:
        super().__init__(message or f"{argument} {requirement}")
        self.argument = argument
        self.requirement = requirement

    @classmethod
    def wrapping(cls, argument: str, error: ValueError) -> ArgumentValueError:
        """``error`` (raised for the value of ``argument``) with the argument named; its message unchanged."""
        return cls(argument, str(error), message=str(error))


def parse_count(text: str | int) -> int:
    """A parameter count from ``"7B"``, ``"350M"``, ``"1.3b"``, ``"125k"``, ``"125_000_000"`` or an int.

    Example::

        >>> parse_count("7B"), parse_count("1.3b"), parse_count("350M"), parse_count("125,000,000")
        (7000000000, 1300000000, 350000000, 125000000)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        match = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(f"cannot read a parameter count from {text!r}; write e.g. 7B, 350M, 1.3b or 125000000")
        try:
            value = Decimal(match[1].replace("_", "").replace(",", "")) * _COUNT_SUFFIXES[match[2].lower()]
        except InvalidOperation as error:
            raise ValueError(f"cannot read a parameter count from {text!r}") from error
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"a parameter count must be a whole number >= 0, got {text!r}")
    if value > MAX_COUNT:
        raise ValueError(f"a parameter count must be at most 2**53 (about 9.0e15), got {text!r}")
    return int(value)


def parse_bytes(text: str | float) -> float:
    """Bytes from ``"80GB"`` (decimal: 80e9), ``"80GiB"`` (binary: 80 * 2**30), ``"512MB"``, or a number.

    Example::

        >>> parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("512 MB"), parse_bytes(1024)
        (80000000000.0, 85899345920.0, 512000000.0, 1024.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(f"cannot read a size in bytes from {text!r}; write e.g. 80GB, 80GiB or 512MB")
        value = float(match[1]) * _BYTE_UNITS[(match[2] or "").lower()]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"a size in bytes must be positive, got {text!r}")
    return value


def parse_argument(argument: str, parse: Callable[[T], R], value: T) -> R:
    """``parse(value)``, its ``ValueError`` an ``ArgumentValueError`` naming ``argument`` (the message unchanged).

    Example::

        shard = parse_argument("shard_size", lambda size: resolve_shard_size(size, 16, 8), "node")
    """
    try:
        return parse(value)
    except ArgumentValueError:
        raise
    except ValueError as error:
        raise ArgumentValueError.wrapping(argument, error) from error
