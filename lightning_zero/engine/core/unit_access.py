"""``UnitAccess``: what user code and the optimizer do to a unit's parameters outside the unit's own use.

A parameter's ``.data`` rebound by user code (``p.data = x``: ``torch.nn.utils.prune.remove``, Lightning's
``ModelPruning``) is adopted into the unit (``adopt_rebound_data``), and the memory it was rebound to keeps seeing the
parameter train (``refresh_aliases``); full values are shown for a while and written back (``show``, ``take_writes``,
``hide_again``: ``ShardedModel.gathered_parameters``); a read of a sharded parameter's values is a gather of its own
(``read_values``: see [Note: reading a sharded parameter] in ``placeholder.py``). ``ShardedUnit`` (``unit.py``)
builds on it, and gives the gather lifecycle these methods wait for.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.engine.core.compute_shard import ShardStorage
from lightning_zero.engine.core.placeholder import (
    ShardedParameterReadError,
    check_conversion,
    hide,
    passthrough,
    reveal,
)
from lightning_zero.engine.core.unit_state import ParamView, UnitState

_DATA_PTR = torch.Tensor.data_ptr


class UnitAccess(ShardStorage):
    """The access of user code and the optimizer to a unit's parameters (see the module docstring); the state it
    reads (``_views``, ``_placeholders``, ``view``, ``_aliases``, ``state``) and the gather it waits for
    (``_finish_gather``, ``gather_updated_shards``) are ``ShardedUnit``'s."""

    _views: list[torch.Tensor]
    _placeholders: list[torch.Tensor]
    view: ParamView
    _aliases: dict[int, torch.Tensor]
    _empty: list[int]
    state: UnitState
    between_runs: str | None

    @property
    def exposed(self) -> bool:
        """Whether the parameters are views of ``flat`` (shown, or arriving), not placeholders."""
        return self.view is not ParamView.HIDDEN

    def _finish_gather(self) -> None:
        raise NotImplementedError  # ShardedUnit's

    def gather_updated_shards(self, async_op: bool = False) -> object:
        raise NotImplementedError  # ShardedUnit's

    def record_hidden_versions(self) -> None:
        raise NotImplementedError  # ShardedUnit's

    def full_flat(self, purpose: str | None = None) -> torch.Tensor:
        raise NotImplementedError  # ShardedUnit's

    def _set_param_data(self, tensors: list[torch.Tensor]) -> None:
        for param, data in zip(self.params, tensors):
            param.data = data

    # ------------------------------------------------------------------ rebound data
    def adopt_rebound_data(self) -> None:
        """Take over values that user code gave a parameter by rebinding its ``.data`` (``p.data = x``: what
        ``torch.nn.utils.prune.remove`` and Lightning's ``ModelPruning`` do), which would otherwise detach it
        from the unit: the values go into the flat buffer and this rank's master piece, and the parameter
        points where it should again. Local (no collective); cheap when nothing was rebound."""
        with passthrough():
            self._adopt_rebound_data()

    def _adopt_rebound_data(self) -> None:
        expected = self._views if self.exposed else self._placeholders
        if list(map(_DATA_PTR, self.params)) == list(map(_DATA_PTR, expected)):
            return  # nothing rebound (the common case, checked in C; the loop below also lets empty parameters be)
        adopted = False
        for index, (param, want) in enumerate(zip(self.params, expected)):
            if param.data_ptr() == want.data_ptr() or param.numel() == 0:
                continue
            if self._on_master_piece(param, index):
                continue  # inside an optimizer step (ShardedModel.on_shards)
            new = param.data
            check_conversion(f"parameter {self.param_names[index]!r}", want, new.dtype, new.device)
            if new.shape != want.shape:
                raise ValueError(
                    f"parameter {self.param_names[index]!r} was given data of shape {tuple(new.shape)} "
                    f"(param.data = ...), but it was sharded with shape {tuple(want.shape)}: ZeRO cannot change a "
                    "parameter's shape during training. Keep the shape, or rebuild the model before fit."
                )
            adopted = True
            with torch.no_grad():
                if self.state is UnitState.UNSHARDED:  # gathered, or being gathered ahead of its use: the new
                    self._finish_gather()  # values go into the gathered buffer too, once the gather is done
                    self._views[index].copy_(new)
                piece = self.param_shards[index]
                if piece.numel:
                    values = new.reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
                    target = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
                    self.wait_host_reads()
                    target.copy_(values)
                    if self.separate_master and self.shard is not None and self.shard is not self.master:
                        # the compute-dtype shard gathers read
                        self.shard[piece.shard_offset : piece.shard_offset + piece.numel].copy_(target)
            # Under DDP the rebound parameter trains in the memory it was given, so whoever holds that memory (the
            # tensor ``x`` of ``p.data = x``) sees it train: ``refresh_aliases`` keeps that true here.
            self.keep_alias(index, new)
            param.data = want
        if adopted and not self.exposed:  # (only then: re-recording would hide a write made into a placeholder)
            self.record_hidden_versions()

    def keep_alias(self, index: int, memory: torch.Tensor) -> None:
        """Remember that user code rebound parameter ``index`` to ``memory`` (see ``adopt_rebound_data``)."""
        self._aliases[index] = memory

    def refresh_aliases(self, values: list[torch.Tensor] | None = None) -> None:
        """Copy the parameters' current values (``values``, or the parameters themselves when they show them) into
        the memory user code once rebound them to (see ``adopt_rebound_data``)."""
        with torch.no_grad():
            for index, alias in self._aliases.items():
                alias.copy_(values[index] if values is not None else self.params[index])

    def _on_master_piece(self, param: nn.Parameter, index: int) -> bool:
        piece = self.shard_params[index]
        return param.data_ptr() == piece.data_ptr() and param.shape == piece.shape

    def shown_data(self) -> list[torch.Tensor]:
        """What each parameter's ``.data`` is now, once ``adopt_rebound_data`` has run: its view of the gathered
        values, or its placeholder (an empty parameter keeps whatever it was given: nothing is adopted for it)."""
        shown = list(self._views if self.exposed else self._placeholders)
        for index in self._empty:
            shown[index] = self.params[index].data
        return shown

    # ------------------------------------------------------------------ full values for user code and optimizer steps
    @property
    def needs_gather_to_read(self) -> bool:
        """Whether the parameters may not show the master values (stage 3, or a separate master)."""
        return self.reshard_after_forward or self.separate_master

    def show(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Point the parameters at ``tensors``; return what they pointed at (to ``show`` again later). Writes made
        meanwhile are the caller's to handle (``take_writes``)."""
        self._finish_gather()
        with passthrough():
            previous = [p.data for p in self.params]
        reveal(self.params)
        self._set_param_data(tensors)
        return previous

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a full flat tensor (``full_flat()``)."""
        return [
            full[offset : offset + numel].view(p.shape)
            for p, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels)
        ]

    def take_writes(self, full: torch.Tensor) -> None:
        """After user code wrote into a gathered copy: this rank's slice becomes the master shard, and the
        compute copies are refreshed from the shards (a collective when the full parameters are kept)."""
        start, end = self.layout.shard_range(self.comm.rank)
        with torch.no_grad():
            self.wait_host_reads()
            self.master.copy_(full[start:end])
        pending = self.gather_updated_shards()
        if pending is not None:
            pending.wait()

    def hide_again(self, previous: list[torch.Tensor]) -> None:
        """Undo ``show``: the parameters point at ``previous`` again; what was written meanwhile is not a write
        into a placeholder."""
        self._set_param_data(previous)
        self.conceal_if_sharded()
        self.record_hidden_versions()

    def reveal(self) -> None:
        """Let the parameters behave as plain tensors (of whatever their ``.data`` is) until ``conceal_if_sharded``:
        for the engine's own work on them, e.g. an optimizer step on the master pieces (which may be slices of the
        buffer a gather in flight writes: waited for first)."""
        self._finish_gather()
        reveal(self.params)

    def conceal_if_sharded(self) -> None:
        """After ``reveal``: while the unit is sharded, reads go through [Note: reading a sharded parameter] again."""
        if not self.exposed:
            hide(self.params, self, self._hidden_classes)

    def read_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The values of ``params`` (some of this unit's), gathered from every rank into a read-only copy in the
        master dtype (see [Note: reading a sharded parameter]). A collective: every rank reads the same."""
        names = [n for p, n in zip(self.params, self.param_names) if any(p is q for q in params)]
        if self.between_runs is not None:
            raise ShardedParameterReadError(
                f"parameter {names[0]!r} (unit {self.name!r}) was read between runs: the model stayed sharded when the "
                f"run ended, since its full parameters would not fit ({self.between_runs}). Its values can be read "
                "in the next trainer.validate/test/predict with the same Trainer, saved with "
                "trainer.save_checkpoint(...) on every rank (written in pieces, never whole) and read whole from the "
                "file with lightning_zero.consolidate_checkpoint(...), or gathered with "
                "trainer.strategy.full_state_dict() on every rank where they fit."
            )
        with torch.no_grad():
            views = self.full_views(self.full_flat(f"a read of {', '.join(names)} outside its forward"))
        return [views[next(i for i, p in enumerate(self.params) if p is q)] for q in params]
