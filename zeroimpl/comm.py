"""The collectives zeroimpl issues, in one place so that they can be read, counted and replaced.

torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to ``reduce_scatter_single`` /
``all_gather_single``; the functions are looked up on ``torch.distributed`` at call time, so the newest
name is used where it exists and a test can wrap ``torch.distributed`` attributes to count traffic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _collective(new_name: str, old_name: str):
    return getattr(dist, new_name, None) or getattr(dist, old_name)


class _Done:
    """The handle of work that finished when it was issued."""

    def wait(self) -> bool:
        return True


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Start ``output = sum over ranks of input[rank * n:(rank + 1) * n]``; ``n = output.numel()``."""
    if dist.get_world_size(group) == 1:  # nothing to sum: skip the backend's own copies
        output.copy_(input[:output.numel()])
        return _Done()
    launch = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    return launch(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Start ``output[rank * n:(rank + 1) * n] = input`` of every rank; ``input`` may be that slice of ``output``."""
    if dist.get_world_size(group) == 1:
        if input.data_ptr() != output.data_ptr():
            output.copy_(input)
        return _Done()
    launch = _collective("all_gather_single", "all_gather_into_tensor")
    return launch(output, input, group=group, async_op=True)


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    """Reduce ``tensor`` in place across the group and return it."""
    dist.all_reduce(tensor, op=op, group=group)
    return tensor
