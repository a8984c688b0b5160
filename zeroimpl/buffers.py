"""Flat parameter storage: one buffer per bucket, every parameter a view into it.

Tensors named here (all 1-D unless said otherwise):

* ``param_buffer`` -- ``bucket.padded_numel`` elements in the model's dtype on the model's device. After
  :func:`flatten_params`, ``param.data`` of every bucket member is a view of it (shape of the parameter),
  so an in-place all-gather into ``param_buffer`` updates the model without any copy.
* ``shard`` -- this rank's ``bucket.shard_numel`` elements of ``param_buffer`` (a view).
* ``master`` -- the tensor the inner optimizer updates. For fp32 (or wider) models it *is* ``shard``: the
  model's own parameters are the master weights, no copy. For 16-bit models it is an fp32 copy of
  ``shard`` that only this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Bucket, ShardLayout

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class BucketStorage:
    """Parameter memory of one bucket on this rank."""

    bucket: Bucket
    params: list[torch.nn.Parameter]  # bucket members, in buffer order
    param_buffer: torch.Tensor  # (padded_numel,), model dtype
    shard: torch.Tensor  # (shard_numel,), view of param_buffer
    master: torch.Tensor  # (shard_numel,), fp32 for 16-bit models, else the same tensor as shard

    @property
    def has_separate_master(self) -> bool:
        return self.master is not self.shard

    def publish_master(self) -> None:
        """Write the updated master weights into this rank's shard of the model parameters."""
        if self.has_separate_master:
            self.shard.copy_(self.master)


def flatten_params(layout: ShardLayout, params: list[torch.nn.Parameter], rank: int) -> list[BucketStorage]:
    """Move ``params`` (indexed as in ``layout``) into flat bucket buffers and rebind ``param.data`` to views.

    Values are preserved exactly; padding is zero.
    """
    storages = []
    for bucket in layout.buckets:
        members = [params[i] for i in bucket.param_indices]
        first = members[0]
        param_buffer = torch.zeros(bucket.padded_numel, dtype=first.dtype, device=first.device)
        for index, param in zip(bucket.param_indices, members):
            slot = layout.slots[index]
            view = param_buffer[slot.offset:slot.end].view(param.shape)
            view.copy_(param.data)
            param.data = view
        start, end = bucket.shard_range(rank)
        shard = param_buffer[start:end]
        master = shard.to(torch.float32, copy=True) if first.dtype in HALF_DTYPES else shard
        storages.append(BucketStorage(bucket, members, param_buffer, shard, master))
    return storages
