"""pytest plugin (``-p swap_strategy``): Lightning's DDP strategy strings become lightning_zero's stages, so that
Lightning's own tests run under ZeRO unedited (see README.md beside this file).

SWAP_STAGE=1|2|3 -> strategy "ddp" -> "zeroN", "ddp_spawn" -> "zeroN_spawn", "ddp_fork"/"ddp_notebook" -> "zeroN_fork".
SWAP_STAGE unset/0 -> no swap (DDP baseline). Test sources are not touched.
The rewrite happens in _AcceleratorConnector.__init__, i.e. for every Trainer(strategy=...) string.
Strategy *instances* (DDPStrategy(...)) are left alone.
"""

from __future__ import annotations

import os
from typing import Any

_STAGE = os.environ.get("SWAP_STAGE", "0")
SWAPS = []  # record of swaps made in this process

if _STAGE in ("1", "2", "3"):
    from lightning.pytorch.trainer.connectors import accelerator_connector as _ac

    import lightning_zero  # noqa: F401  registers zero1/2/3 (+ _spawn, _fork, ...)

    _MAP = {
        "ddp": f"zero{_STAGE}",
        "ddp_spawn": f"zero{_STAGE}_spawn",
        "ddp_fork": f"zero{_STAGE}_fork",
        "ddp_notebook": f"zero{_STAGE}_fork",
    }
    _orig_init = _ac._AcceleratorConnector.__init__

    def _patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        s = kwargs.get("strategy")
        if isinstance(s, str) and s in _MAP:
            kwargs["strategy"] = _MAP[s]
            SWAPS.append((s, _MAP[s]))
            if os.environ.get("SWAP_VERBOSE"):
                print(f"[swap_strategy] strategy {s!r} -> {_MAP[s]!r}", flush=True)
        _orig_init(self, *args, **kwargs)

    _ac._AcceleratorConnector.__init__ = _patched_init


def pytest_report_header(config: Any) -> str:
    return f"swap_strategy: SWAP_STAGE={_STAGE}"


def pytest_runtest_logreport(report: Any) -> None:
    # annotate each test report with the swaps performed (visible with -rA via user_properties)
    if report.when == "call" and SWAPS:
        report.user_properties.append(("swaps", sorted(set(SWAPS))))
