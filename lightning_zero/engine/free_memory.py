"""How much more memory a device can give this process: the check before anything is built whole.

[Note: what fits at the end]
Training under ZeRO holds shards; the end of a run may want full tensors again (the module's
parameters, the optimizers' per-parameter states, as DDP leaves them). A model that trains only
because it is sharded cannot have them, and building them anyway ends the process at the last
moment. So before anything is gathered whole, every rank compares the bytes it would add with what
its device can still give, keeping a margin (``FIT_MARGIN``), and the ranks agree: all gather, or
none does.

- CUDA: ``torch.cuda.mem_get_info`` (free on the device) plus what the caching allocator holds
  reserved but unused.
- CPU: the least of ``MemAvailable`` (``/proc/meminfo``) and the cgroup's limit less its usage
  (v2 ``memory.max``/``memory.current``, or v1), shared by the ranks of this node (they gather at the
  same moment: ``LOCAL_WORLD_SIZE``), and of the address space ``RLIMIT_AS`` leaves this process.
- Unknown (no such file, another OS): ``None``, and callers keep their behaviour.

What does not fit stays sharded (``ShardedModel.release``): optimizer states keep this rank's shard
and refuse what needs them whole (``ShardedOptimizerStateError``); full parameters are not gathered
at all, and the module stays sharded between runs, with its hooks (``ShardedModel.suspend``): the
next run of the same strategy takes it as it is (``resume``, with that run's control channel),
a read of a parameter in between says why and how to get full weights, and another strategy is
refused it at setup (``placeholder.refuse_module_sharded_elsewhere``).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

FIT_MARGIN = 0.8  # use at most this share of what is free


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The cgroup's memory limit less its usage, if it has a limit."""
    v2 = Path("/sys/fs/cgroup")
    limit, used = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None or used is None:
        v1 = v2 / "memory"
        limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
    if limit is None or used is None or limit >= 1 << 60:  # "max", or v1's "no limit"
        return None
    return max(limit - used, 0)


def _address_space_room() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(soft - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: torch.device) -> int | None:
    """Bytes this process can still allocate on ``device`` (its share of the node's host memory on the CPU), or
    ``None`` where that cannot be known (see [Note: what fits at the end])."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    host = [room for room in (_mem_available(), _cgroup_room()) if room is not None]
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    rooms = [min(host) // ranks] if host else []
    own = _address_space_room()
    if own is not None:
        rooms.append(own)
    return min(rooms) if rooms else None


def fits(needed: int, device: torch.device) -> bool:
    """Whether ``needed`` more bytes fit on ``device`` with the margin (``True`` where it cannot be known)."""
    room = available_bytes(device)
    return room is None or needed <= FIT_MARGIN * room


def describe_bytes(count: float) -> str:
    """``count`` bytes for a message: ``"3.2 GiB"``."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def kept_sharded_text(reason: str, fabric: bool = False) -> str:
    """What to tell the user (on rank 0) when a run ended with the module kept sharded, because ``reason``."""
    if fabric:
        after = "For full weights, save before teardown with fabric.save(...) on every rank"
    else:
        after = (
            "The next trainer.validate/test/predict of the same Trainer uses it as it is. For full weights, save "
            "with trainer.save_checkpoint(...) on every rank"
        )
    return (
        f"lightning_zero: the model stays sharded after this run: its full parameters were not gathered, since "
        f"{reason}. {after} (written in pieces, never whole) and read the file with "
        "lightning_zero.consolidate_checkpoint(...)."
    )
