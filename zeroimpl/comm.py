"""The collectives zeroimpl issues, in one place so that they can be read, counted and replaced.

torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to ``reduce_scatter_single`` /
``all_gather_single``; the functions are looked up on ``torch.distributed`` at call time, so the newest
name is used where it exists and a test can wrap ``torch.distributed`` attributes to count traffic.

Every wait goes through :class:`Pending`: a collective that fails (a peer died: gloo sees the connection
drop) or does not finish within ``timeout`` seconds (a peer hangs) raises :class:`CollectiveError` on this
rank instead of blocking forever. ``timeout=None`` leaves the bound to the process group's own timeout
(``init_process_group(timeout=...)``). The timeout applies to CPU tensors (gloo) only: on CUDA, a wait with
a timeout would block the host until the collective ends and lose the overlap with backward, so there
NCCL's watchdog enforces the process group's timeout (it aborts the process).
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective of ShardedOptimizer failed or timed out: another rank has died, hangs, or diverged."""


def _collective(new_name: str, old_name: str):
    return getattr(dist, new_name, None) or getattr(dist, old_name)


class Pending:
    """An issued collective (or ``work=None``: one that finished when it was issued)."""

    def __init__(self, work: Optional[dist.Work], name: str, timeout: Optional[float]):
        self.work, self.name, self.timeout = work, name, timeout

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            if self.timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            bound = (f"within collective_timeout={self.timeout} s" if self.timeout
                     else "within the process group's timeout")
            raise CollectiveError(
                f"ShardedOptimizer's {self.name} failed or did not finish {bound} ({error}). Another rank has "
                "probably died, hangs, or runs a different number of backward passes or steps; this rank cannot "
                "continue. Restart the job from the last checkpoint (zeroimpl.checkpoint.load_checkpoint; "
                "torchrun --max-restarts=N restarts every rank)") from error


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, timeout: Optional[float] = None) -> Pending:
    """Start ``output = sum over ranks of input[rank * n:(rank + 1) * n]``; ``n = output.numel()``."""
    if dist.get_world_size(group) == 1:  # nothing to sum: skip the backend's own copies
        output.copy_(input[:output.numel()])
        return Pending(None, "reduce-scatter", timeout)
    launch = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    return Pending(launch(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True),
                   "gradient reduce-scatter", _host_timeout(input, timeout))


def all_gather(output: torch.Tensor, input: torch.Tensor, group, timeout: Optional[float] = None) -> Pending:
    """Start ``output[rank * n:(rank + 1) * n] = input`` of every rank; ``input`` may be that slice of ``output``."""
    if dist.get_world_size(group) == 1:
        if input.data_ptr() != output.data_ptr():
            output.copy_(input)
        return Pending(None, "all-gather", timeout)
    launch = _collective("all_gather_single", "all_gather_into_tensor")
    return Pending(launch(output, input, group=group, async_op=True), "parameter all-gather",
                   _host_timeout(output, timeout))


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group, timeout: Optional[float] = None,
                name: str = "all-reduce") -> torch.Tensor:
    """Reduce ``tensor`` in place across the group and return it."""
    Pending(dist.all_reduce(tensor, op=op, group=group, async_op=True), name, _host_timeout(tensor, timeout)).wait()
    return tensor


def _host_timeout(tensor: torch.Tensor, timeout: Optional[float]) -> Optional[float]:
    """The timeout for a wait on ``tensor``'s collective: none on CUDA (see the module docstring)."""
    return timeout if tensor.device.type == "cpu" else None
