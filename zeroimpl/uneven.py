"""Uneven inputs under ``torch.distributed.algorithms.Join``: a clear error on every rank, never a hang. Under
``Join([optimizer])`` ranks out of data leave the loop early and, by torch's protocol, *shadow* the others' collectives.
A sharded optimizer cannot be: the joined rank owns a shard of the gradients and state, so it would have to take part in
every collective of the iteration, in an order only the others know. ShardedOptimizer uses the protocol to *detect*
uneven inputs instead: at the start of each round of collectives (the first gradient of a stage-2 backward; the step) a
rank that has not joined announces itself and all-reduces a flag that a joined rank's hook sets, so every rank raises
:class:`UnevenInputsError` at the same point. Cost, inside a ``Join`` only: two one-element all-reduces per round (three
with ``throw_on_early_termination``), bounded by ``collective_timeout``."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook, Joinable

from . import comm

MESSAGE = ("uneven inputs: a rank ran out of data inside `with Join([...])` while others went on. ShardedOptimizer "
           "shards gradients and optimizer state, so a rank without data cannot shadow the others' reduce-scatters, "
           "step and all-gathers. Give every rank the same number of batches per epoch (a DistributedSampler with "
           "drop_last=True, or stop all ranks when the first runs out: all_reduce a flag with ReduceOp.MIN), or "
           "train with DistributedDataParallel under Join")


class UnevenInputsError(RuntimeError):
    """A rank ran out of data under ``Join``; raised on every rank at the same collective."""


class RefuseUnevenInputs(JoinHook):
    """The hook of a rank that joined: it tells the ranks still training, then raises."""

    def __init__(self, device: torch.device, group, timeout: Optional[float] = None) -> None:
        self.device, self.group, self.timeout = device, group, timeout

    def main_hook(self) -> None:
        comm.all_reduce_(torch.ones(1, device=self.device), dist.ReduceOp.SUM, self.group, self.timeout,
                         "uneven inputs flag", read_on_host=True)
        raise UnevenInputsError(MESSAGE)


class UnevenInputs:
    """One ``Joinable``'s check-in before each round of its collectives (held weakly: it owns this object)."""

    def __init__(self, joinable: Joinable, device: torch.device, group, timeout: Optional[float] = None) -> None:
        self._joinable = weakref.ref(joinable)  # read for the _join_config that torch's Join sets on it
        self.device, self.group = device, group  # where the flag is all-reduced: the joinable's own
        self.timeout = timeout  # bounds the flag's all-reduce (collective_timeout)

    @property
    def active(self) -> bool:
        joinable = self._joinable()
        return joinable is not None and joinable._join_config.enable

    def check_in(self) -> None:
        """Inside an active ``Join``, announce this rank; raise :class:`UnevenInputsError` if a rank has joined."""
        if not self.active:
            return
        config = self._joinable()._join_config
        if config.is_first_joinable:
            # torch's Join.notify_join_context, issued here so that its waits are bounded: the notification, and with
            # throw_on_early_termination the check whether another rank joined (their other side: Join.__exit__)
            notified = comm.all_reduce(torch.ones(1, device=self.device), dist.ReduceOp.SUM, self.group, self.timeout,
                                       "Join notification")
            if config.throw_on_early_termination:
                self._raise_if_joined("Join termination check")
            notified.wait_on_host()
        self._raise_if_joined("uneven inputs flag")

    def _raise_if_joined(self, name: str) -> None:
        joined = torch.zeros(1, device=self.device)
        comm.all_reduce_(joined, dist.ReduceOp.SUM, self.group, self.timeout, name, read_on_host=True)
        if joined.item() > 0:  # a host sync per check-in, under Join only
            raise UnevenInputsError(MESSAGE)
