"""Where this rank's averaged gradient shards live between the reduction and the optimizer step.

Both stores take the output of each bucket's reduce-scatter (``reduced``: ``bucket.shard_numel`` elements
in the reduce dtype, on the device), accumulate across reductions until ``clear()``, and hand the optimizer
one tensor per bucket in ``ready()``. They store; they call nothing above them (the step publishes the
masters: :mod:`zeroimpl.param_sync`):

* :class:`DeviceGradientShards` -- no offload: the shards stay on the device, in the reduce dtype.
* :class:`zeroimpl.offload.HostGradientShards` -- CPU offload: fp32 shards in (pinned) host memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch



class DeviceGradientShards:
    """Gradient shards on the device, one per bucket, ``None`` until the bucket's first reduction."""

    def __init__(self, num_buckets: int):
        self.shards: list[Optional[torch.Tensor]] = [None] * num_buckets  # (shard_numel,), reduce dtype
        self.accumulating = False  # no effect here: shards accumulate on the device anyway

    def add(self, bucket_index: int, reduced: torch.Tensor) -> None:
        if self.shards[bucket_index] is None:
            self.shards[bucket_index] = reduced  # the first reduction is taken as is: bitwise like DDP
        else:
            self.shards[bucket_index].add_(reduced)

    def wait_copies(self) -> None:
        """Nothing to wait for: no copies leave the device."""

    def ready(self) -> list[Optional[torch.Tensor]]:
        return self.shards

    def clear(self, set_to_none: bool) -> None:
        if set_to_none:
            self.shards = [None] * len(self.shards)
        else:
            for shard in self.shards:
                if shard is not None:
                    shard.zero_()

    @property
    def has_gradients(self) -> bool:
        return any(shard is not None for shard in self.shards)

    def device_tensors(self) -> list[torch.Tensor]:
        return [s for s in self.shards if s is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        return []


@contextlib.contextmanager
def accumulating(store) -> Iterator[None]:
    """Set ``store.accumulating`` (either store) inside the block: the backward passes inside are non-final
    micro-batches (offload sums them on the device)."""
    previous = store.accumulating
    store.accumulating = True
    try:
        yield
    finally:
        store.accumulating = previous
