"""Whether a ``ShardedOptimizer.state_dict()`` may be loaded here, agreed by every rank before anything changes.

Each rank's state holds that rank's shard only. A loop that saves ``optimizer.state_dict()`` on the master
process alone (nanoGPT, many scripts written for DDP) hands rank 0's shard to every rank at resume: the
rank that can load it must not go on into the next collective while another refuses, or the job hangs.
So :func:`agree_to_load` gathers every rank's verdict (one small object all-gather) and raises the same
refusal on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from .memory_format import contiguous_strides, same_order
from .topology import Topology

STATE_FORMAT = "zeroimpl.sharded_optimizer/2"  # /1 held the inner state per bucket, not per piece
OLD_STATE_FORMAT = "zeroimpl.sharded_optimizer/1"


def load_problem(state_dict, rank: int, world_size: int, layout_fingerprint: dict, params: list[torch.Tensor],
                 num_groups: int, loss_scaling: bool) -> Optional[str]:
    """Why this rank cannot load ``state_dict`` into an optimizer of shard rank ``rank`` of ``world_size``, with
    this layout, these trainable parameters, ``num_groups`` param groups and loss scaling on or off; None if
    it can. Local."""
    if isinstance(state_dict, dict) and state_dict.get("format") == OLD_STATE_FORMAT:
        return ("this state was saved by an older zeroimpl, whose optimizer state was per bucket; it cannot be "
                "loaded with load_state_dict. Resume from a checkpoint written by zeroimpl.checkpoint.save_checkpoint "
                "instead (those of every version load)")
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        return (f"not a ShardedOptimizer state dict (missing format tag {STATE_FORMAT!r}); a plain torch optimizer "
                "state needs the checkpoint API")
    if state_dict["rank"] != rank or state_dict["layout"] != layout_fingerprint:
        return (f"this state was saved by rank {state_dict['rank']} with world size "
                f"{state_dict['layout']['world_size']}"
                f"{'' if state_dict['layout'] == layout_fingerprint else ' and another parameter layout'}; this "
                f"optimizer is rank {rank} of {world_size}. Each rank holds its own shard of the optimizer state: save "
                "optimizer.state_dict() on every rank (not on the master process alone) and load each rank's own, "
                "with the same model, param groups, world size and bucket settings, or use "
                "zeroimpl.checkpoint.save_checkpoint / load_checkpoint (which also reshard to another world size)")
    saved = state_dict.get("strides") or [contiguous_strides(p.shape) for p in params]
    for index, (strides, param) in enumerate(zip(saved, params)):
        if not same_order(param.shape, strides, param.stride()):
            return (f"trainable parameter {index} {tuple(param.shape)} was saved in the memory format of strides "
                    f"{tuple(strides)} but has strides {tuple(param.stride())} here, so its shard would be read in "
                    "the wrong order: give the parameters the memory format they had when saved before building "
                    "the optimizer (model.to(memory_format=...); a state saved before zeroimpl kept memory "
                    "formats holds every parameter contiguous: p.data = p.data.contiguous())")
    if len(state_dict["param_groups"]) != num_groups:
        return "the state has a different number of param groups"
    if (state_dict["loss_scaler"] is None) == loss_scaling:
        return "the state's loss scaler does not match this optimizer (loss scaling on in one, off in the other)"
    return None


def agree_to_load(problem: Optional[str], topology: Topology, timeout: Optional[float]) -> None:
    """Raise ``ValueError`` on every rank if any rank has a ``problem`` (its own, or the first other rank's, named).
    Collective: one all-gather of each rank's verdict."""
    problems = topology.all_gather_objects(problem, timeout, "state dict agreement")
    if problem is not None:
        raise ValueError(problem)
    refused = next(((rank, text) for rank, text in enumerate(problems) if text is not None), None)
    if refused is not None:
        raise ValueError(f"rank {refused[0]} (in all-gather order) refused its optimizer state, so no rank loads "
                         f"one: {refused[1]}")
