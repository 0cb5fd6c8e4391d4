"""Names for the engine's work in a ``torch.profiler`` trace.

[Note: profiler labels]
A user's ``torch.profiler.profile()`` trace should show where a step's time goes: which collective, of which
unit, and which hook around it. The engine opens a ``record_function`` range at each place it issues work:

- ``Comm`` (the transport, one range per collective issued, checks and copies included): ``ZeRO::all_gather``,
  ``ZeRO::reduce_scatter``, ``ZeRO::all_reduce`` (the gradient flags, a replica all-reduce under hybrid sharding,
  a gradient norm), ``ZeRO::broadcast``; ``ZeRO::wait_<kind>`` where the host waits for one in flight (on gloo
  the host blocks there; on NCCL it returns at once and the device time is in the trace's CUDA rows), and
  ``ZeRO::agree`` for an agreement on the control channel (see [Note: collective checks] in ``sequence.py``);
- ``ShardedUnit`` (one unit's parameters and gradients, the unit's name in brackets): ``ZeRO::gather`` (an
  all-gather of the unit's parameters, with the storage it fills and the copy it reads), ``ZeRO::serve_gather``
  (this rank's part in another rank's all-gather of the unit, into a buffer dropped at once: see [Note: joined
  forwards] in ``schedule/joined.py``), ``ZeRO::release`` (its storage freed), ``ZeRO::reduce_grads`` (its
  gradients packed and reduce-scattered);
- the schedule (stage 3's hooks and the end of backward): ``ZeRO::pre_forward``, ``ZeRO::post_forward``,
  ``ZeRO::pre_backward`` (with the unit's name), ``ZeRO::finish_backward``, ``ZeRO::settle_grads`` (the backward
  passes' flags read before the optimizer step: see [Note: flags read at the step] in ``schedule/grad_flags.py``).

A ``record_function`` costs a few microseconds even when no profiler records (it enters the dispatcher), and a
step opens about a dozen per unit. So ``label`` opens one only while a profiler is active, which
``torch.autograd.profiler._is_profiler_enabled`` says (set by every profiler torch has, as ``torch.compile``'s own
labels check it), and otherwise returns a context that does nothing: about 0.1 microseconds (measured with
``timeit`` over 10,000 calls against about 6 for a ``record_function``), and the name is not even formatted.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.autograd import profiler as _profiler

_OFF = nullcontext()  # reusable: entering it does nothing


def label(name: str, unit: str | None = None) -> AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``name`` (``"name (unit)"`` with a unit) while a profiler records, else a
    context that does nothing (see [Note: profiler labels]).

    Example::

        with label("ZeRO::gather", unit.name):
            ...                                  # shows as "ZeRO::gather (layers.0)" in a trace
    """
    if not _profiler._is_profiler_enabled:
        return _OFF
    return _profiler.record_function(name if unit is None else f"{name} ({unit})")
