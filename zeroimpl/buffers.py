"""One flat parameter buffer per bucket. ``param_buffer``: ``bucket.padded_numel`` elements, model dtype and device;
every member's ``param.data`` is a view of it (its shape and memory format), so an all-gather into it updates the model
in place. ``shard``: this rank's ``bucket.shard_numel`` of them, a view. ``master``: what the inner optimizer steps, at
least fp32; ``shard`` itself or a copy of its own (16-bit model, quantized all-gather, CPU offload: on the host).
``published`` (quantized all-gather): ``shard`` as the last all-gather left it, the base of deltas and edit checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from . import comm
from .layout import Bucket, ShardLayout, overlap
from .memory_format import dense_strides, shaped
from .precision import at_least_fp32
from .quantized_comm import ShardBlocks

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class BucketStorage:
    """Parameter memory of one bucket on this rank."""

    bucket: Bucket
    params: list[torch.nn.Parameter]  # bucket members, in buffer order
    param_buffer: torch.Tensor  # (padded_numel,), model dtype
    shard: torch.Tensor  # (shard_numel,), view of param_buffer
    master: torch.Tensor  # (shard_numel,), a copy of shard (16-bit, quantized or offload) or shard itself
    blocks: Optional[ShardBlocks] = None  # quantized all-gather: its blocks (zeroimpl.quantized_comm)
    published: Optional[torch.Tensor] = None  # quantized all-gather: the shard as the last all-gather left it
    edited: bool = False  # quantized all-gather: a member was written outside the optimizer since the last step
    _versions: tuple = field(default=(), repr=False)  # params' version counters when master was last in sync
    _addresses: dict = field(default_factory=dict, repr=False)  # parameter index -> data_ptr of its view

    def __post_init__(self) -> None:
        self._addresses = {i: p.data_ptr() for i, p in zip(self.bucket.param_indices, self.params)}
        self.mark_master_in_sync()

    def holds(self, param_index: int, param: torch.nn.Parameter) -> bool:
        """Whether member ``param_index`` is still its view of ``param_buffer``: converting or moving the model
        (``model.to``, ``.half()``, ``param.data = ...``) rebinds it to other memory."""
        return param.data_ptr() == self._addresses[param_index]

    def rebound_params(self) -> list[int]:
        return [i for i, p in zip(self.bucket.param_indices, self.params) if p.data_ptr() != self._addresses[i]]

    @property
    def has_separate_master(self) -> bool:
        return self.master is not self.shard

    def publish_master(self, staging: Optional[torch.Tensor] = None) -> None:
        """Write the master into this rank's shard of the parameters; asynchronous when the master (or ``staging``)
        is in pinned host memory and the parameters on CUDA. ``staging`` (host, the shard's dtype and size):
        convert there first, so that the copy to the device moves the parameters' bytes, not the master's."""
        if not self.has_separate_master:
            return
        if staging is not None:
            staging.copy_(self.master)
            self.shard.copy_(staging, non_blocking=True)
        elif self.master.device == self.shard.device or self.master.dtype == self.shard.dtype:
            self.shard.copy_(self.master, non_blocking=True)
        else:  # convert on the device, not on the host
            self.shard.copy_(self.master.to(self.shard.device, non_blocking=True))

    def mark_master_in_sync(self) -> None:
        """Record that the master weights and the parameters agree (after a step or a state load)."""
        self._versions = tuple(p._version for p in self.params)

    def sync_master_with_params(self) -> None:
        """Take parameters written outside the optimizer (``model.load_state_dict``, ``torch.nn.init``, in-place
        edits under ``torch.no_grad()``) into the master: each edited member's slice of this shard that differs
        from :meth:`published_values`; else the next step would overwrite them with the stale master. Edits are
        found by autograd's version counters, which writes through ``param.data`` bypass."""
        if not self.has_separate_master or (versions := tuple(p._version for p in self.params)) == self._versions:
            return
        self.edited = True
        shard_start = self.shard.storage_offset() - self.param_buffer.storage_offset()
        published = None
        for param, offset, now, then in zip(self.params, self.bucket.offsets, versions, self._versions):
            common = overlap(offset, offset + param.numel(), shard_start, shard_start + self.shard.numel())
            if now == then or common is None:
                continue
            if published is None:
                published = self.published_values()
            low, high = common[0] - shard_start, common[1] - shard_start
            master, shard = self.master[low:high], self.shard[low:high]
            if self.blocks is None:  # the edited parameter's slice, whole (as model.load_state_dict expects)
                if not torch.equal(published[low:high], shard):
                    master.copy_(shard)
            else:  # quantized: only the elements edited; the others keep their exact masters
                edited = shard != published[low:high]
                master[edited.to(master.device)] = shard[edited].to(master.device, master.dtype)
                published[low:high][edited] = shard[edited]  # (the copy itself: what the shard now holds)
        self._versions = versions

    def published_values(self) -> torch.Tensor:
        """This rank's shard of the parameters if nothing edited it: ``published``, else the master in their dtype."""
        return self.published if self.published is not None else self.master.to(self.shard.device, self.shard.dtype)

    def mark_published(self) -> None:
        if self.published is not None:
            self.published.copy_(self.shard)


def flatten_params(layout: ShardLayout, params: list[torch.nn.Parameter], rank: int,
                   host_masters: Optional[list[torch.Tensor]] = None,
                   quantized: bool = False) -> list[BucketStorage]:
    """Move ``params`` (indexed as in ``layout``) into flat bucket buffers, values exact and padding zero, and rebind
    ``param.data`` to views. ``host_masters`` (CPU offload): per bucket, the host tensor to hold the master.
    ``quantized``: the all-gather sends 8 bits, so each storage gets blocks, ``published`` and a master of its own."""
    quantized = quantized and comm.issues_collectives(layout.world_size)  # (at one rank nothing crosses a link)
    storages = []
    for bucket in layout.buckets:
        members = [params[i] for i in bucket.param_indices]
        first = members[0]
        param_buffer = torch.zeros(bucket.padded_numel, dtype=first.dtype, device=first.device)
        for index, param in zip(bucket.param_indices, members):
            slot = layout.slots[index]
            view = shaped(param_buffer[slot.offset:slot.end], param.shape, dense_strides(param))
            view.copy_(param.data)
            param.data = view
        shard = param_buffer[slice(*bucket.shard_range(rank))]
        if host_masters is not None:
            master = host_masters[bucket.index].copy_(shard)
        elif first.dtype in HALF_DTYPES or quantized:
            master = shard.to(at_least_fp32(first.dtype), copy=True)
        else:
            master = shard
        blocks = published = None
        if quantized:
            blocks = ShardBlocks.of(layout.edges(bucket.index), bucket.shard_numel, layout.world_size, rank)
            published = shard.clone()
        storages.append(BucketStorage(bucket, members, param_buffer, shard, master, blocks, published))
    return storages
