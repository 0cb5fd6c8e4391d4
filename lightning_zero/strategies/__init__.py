"""Lightning strategies: the glue between Lightning and the engine (which imports no Lightning)."""

from lightning_zero.strategies.base import ZeROStrategy
from lightning_zero.strategies.precision import ZeROPrecision
from lightning_zero.strategies.zero1 import ZeRO1Strategy
from lightning_zero.strategies.zero2 import ZeRO2Strategy
from lightning_zero.strategies.zero3 import ZeRO3Strategy

__all__ = ["ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy", "ZeROPrecision", "ZeROStrategy"]
