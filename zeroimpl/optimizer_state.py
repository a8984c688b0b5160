"""A ShardedOptimizer's state: what ``state_dict()`` holds, whether it may be loaded here (agreed by every rank
before anything changes), and installing it -- from a state dict or, through the checkpoint package's seam,
from a state per piece.

Each rank's state holds that rank's shard only. A loop that saves ``optimizer.state_dict()`` on the master
process alone (nanoGPT, many scripts written for DDP) hands rank 0's shard to every rank at resume: the
rank that can load it must not go on into the next collective while another refuses, or the job hangs.
So :func:`agree_to_load` gathers every rank's verdict (one small object all-gather) and raises the same
refusal on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .buffers import BucketStorage
from .inner import OUTER_ONLY_KEYS, InnerOptimizers
from .layout import ShardLayout
from .memory_format import contiguous_strides, same_order
from .offload import KERNEL_KEYS
from .precision import DynamicLossScaler
from .topology import Topology

if TYPE_CHECKING:
    from .optimizer import ShardedOptimizer

STATE_FORMAT = "zeroimpl.sharded_optimizer/2"  # /1 held the inner state per bucket, not per piece
OLD_STATE_FORMAT = "zeroimpl.sharded_optimizer/1"


def load_problem(state_dict, rank: int, world_size: int, layout_fingerprint: dict, params: list[torch.Tensor],
                 num_groups: int, loss_scaling: bool, quantized: bool = False) -> Optional[str]:
    """Why this rank cannot load ``state_dict`` into an optimizer of shard rank ``rank`` of ``world_size``, with
    this layout, these trainable parameters, ``num_groups`` param groups, loss scaling on or off and a quantized
    all-gather or not; None if it can. Local."""
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
    if state_dict.get("quantize_param_gather", False) != quantized:
        return (f"the state was saved with quantize_param_gather={not quantized} and this optimizer has {quantized}: "
                "the model's saved parameters are within a quantization step of the masters in one and the masters "
                "in the other, so "
                "the ranks would hold different parameters; switch through zeroimpl.checkpoint "
                "(save_checkpoint / load_checkpoint), which all-gathers the parameters from the saved masters")
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


def state_dict(rank: int, layout: ShardLayout, params: list[torch.Tensor], inner: InnerOptimizers,
               outer_groups: list[dict], storages: list[BucketStorage],
               loss_scaler: Optional[DynamicLossScaler]) -> dict:
    """This rank's state (tensors by reference, as torch's ``Optimizer.state_dict``): the inner optimizers' state
    over the pieces, each group's hyperparameters, the master shards when they are separate from the
    parameters, and the loss scaler's state. Local; the masters must be in sync with the parameters."""
    separate = any(s.has_separate_master for s in storages)
    quantized = any(s.blocks is not None for s in storages)
    return {
        "format": STATE_FORMAT,
        "rank": rank,
        "layout": layout.fingerprint(),
        "strides": [tuple(p.stride()) for p in params],  # the flat order of every shard
        "inner": inner.state_dict(),
        "param_groups": [{k: v for k, v in g.items() if k not in ("params", "optimizer")} for g in outer_groups],
        "master_weights": [s.master for s in storages] if separate else None,
        "loss_scaler": loss_scaler.state_dict() if loss_scaler else None,
        "quantize_param_gather": quantized,
        "published_shards": [s.published for s in storages] if quantized else None,
    }


def install(inner: InnerOptimizers, outer_groups: list[dict], storages: list[BucketStorage],
            loss_scaler: Optional[DynamicLossScaler], inner_state: dict, hyperparameters: list[dict],
            masters: Optional[list[torch.Tensor]], loss_scaler_state: Optional[dict]) -> None:
    """Install checked state: the inner optimizers' state dict, each group's hyperparameters (the inner
    optimizers keep their own kernel choice), optionally the master shards and the loss-scaler state. No copy
    or gather may still touch the masters or the parameters.

    ``masters`` is ``None`` for a state saved without separate masters (an fp32 model without offload): then
    the masters keep following the parameters, which the user loads.
    """
    kernels = [{k: v for k, v in g.items() if k in KERNEL_KEYS} for g in inner.param_groups]
    # the kernel decides where torch puts state such as `step`: use ours, not the saver's, when loading
    inner_state = {**inner_state, "param_groups": [{**g, **kernel} for g, kernel in
                                                   zip(inner_state["param_groups"], kernels)]}
    inner.load_state_dict(inner_state)  # moves the state to the masters' device and dtype
    for outer, own, saved, kernel in zip(outer_groups, inner.param_groups, hyperparameters, kernels):
        # the saved outer groups are the newer: they mirror the inner ones after each step, and a scheduler
        # may have changed them since (its lr goes into the inner group at the next step)
        outer.update({k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS})
        own.update({k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS | KERNEL_KEYS})
        outer.update(kernel)
        own.update(kernel)
    if masters is not None:
        with torch.no_grad():
            for storage, master in zip(storages, masters):
                storage.master.copy_(master)
                storage.mark_master_in_sync()
    if loss_scaler is not None and loss_scaler_state is not None:
        loss_scaler.load_state_dict(loss_scaler_state)
    inner.report(outer_groups)


def inner_state_dict(inner: InnerOptimizers, piece_masters: list[torch.Tensor], piece_states: list[Optional[dict]],
                     hyperparameters: list[dict]) -> dict:
    """A ``state_dict()`` of the inner optimizers (torch's format) from a state per piece (``piece_masters``'
    order; ``None``: not stepped yet) and each param group's hyperparameters."""
    number = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    state = {number[id(master)]: piece_state for master, piece_state in zip(piece_masters, piece_states)
             if piece_state is not None}
    groups = [{**{k: v for k, v in own.items() if k != "params"},
               **{k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS},
               "params": [number[id(p)] for p in own["params"]]}
              for saved, own in zip(hyperparameters, inner.param_groups)]
    return {"state": state, "param_groups": groups}


def load(optimizer: "ShardedOptimizer", state_dict: dict) -> None:
    """``optimizer.load_state_dict(state_dict)``: check it on every rank (:func:`agree_to_load`), then install it.
    Collective."""
    problem = load_problem(state_dict, optimizer.rank, optimizer.world_size, optimizer.layout.fingerprint(),
                           optimizer.trainable_params, len(optimizer.param_groups), optimizer.loss_scaler is not None,
                           any(s.blocks is not None for s in optimizer.storages))
    agree_to_load(problem, optimizer.topology, optimizer.collective_timeout)
    _install_into(optimizer, state_dict["inner"], state_dict["param_groups"], state_dict["master_weights"],
                  state_dict["loss_scaler"])
    # a quantized all-gather's next step starts from the parameters as saved: the model loads them, before or after
    # (a state without them, from before zeroimpl sent changes, published the dequantized masters)
    for storage in (s for s in optimizer.storages if s.blocks is not None):
        saved = state_dict.get("published_shards")
        storage.published.copy_(saved[storage.bucket.index] if saved else
                                storage.blocks.decoded(storage.blocks.encode(storage.master)))


def restore(optimizer: "ShardedOptimizer", piece_states: list[Optional[dict]], hyperparameters: list[dict],
            masters: Optional[list[torch.Tensor]], loss_scaler_state: Optional[dict],
            published: Optional[list[torch.Tensor]] = None) -> None:
    """``optimizer.restore_state(...)``: install a state per piece; with ``masters``, all-gather the parameters
    exactly from them, or from ``published`` where the all-gather is quantized (collective)."""
    inner_state = inner_state_dict(optimizer.inner, optimizer.pieces.masters, piece_states, hyperparameters)
    _install_into(optimizer, inner_state, hyperparameters, masters, loss_scaler_state)
    if masters is not None:
        optimizer.param_sync.publish_exactly(published)


def _install_into(optimizer: "ShardedOptimizer", inner_state: dict, hyperparameters: list[dict],
                  masters: Optional[list[torch.Tensor]], loss_scaler_state: Optional[dict]) -> None:
    optimizer.param_sync.finish()  # no all-gather may still write the parameters
    optimizer.param_sync.wait_copies()  # no copy may still read the masters
    install(optimizer.inner, optimizer.param_groups, optimizer.storages, optimizer.loss_scaler, inner_state,
            hyperparameters, masters, loss_scaler_state)
