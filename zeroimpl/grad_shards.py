"""Where this rank's averaged gradient shards live between the reduction and the optimizer step. Both stores sum each
bucket's reductions (``reduced``: ``bucket.shard_numel`` elements in the reduce dtype, on the device) until ``clear()``
and hand the optimizer one tensor per bucket (or None) in ``ready()``: :class:`DeviceGradientShards` on the device in
the reduce dtype, :class:`HostGradientShards` (CPU offload) in pinned host memory in the master's dtype, filled by
copies on a side stream."""

from __future__ import annotations

import contextlib
import enum
from typing import ContextManager, Iterator, Optional

import torch

from . import comm


class DeviceGradientShards:
    """Gradient shards on the device, one per bucket, ``None`` until the bucket's first reduction."""

    def __init__(self, num_buckets: int):
        self.shards: list[Optional[torch.Tensor]] = [None] * num_buckets  # (shard_numel,), reduce dtype
        self._widened: dict[int, torch.dtype] = {}  # bucket -> the reduce dtype of a shard unscale() widened

    def add(self, bucket_index: int, reduced: torch.Tensor) -> None:
        shard = self.shards[bucket_index]
        self.shards[bucket_index] = reduced if shard is None else shard.add_(reduced)  # the first as is: bitwise as DDP

    def ready(self) -> list[Optional[torch.Tensor]]:
        return self.shards

    def unscale(self, factor: float) -> None:
        """Multiply by ``factor``, widening 16-bit shards to fp32 until ``clear``: 16 bits would underflow."""
        for index, shard in enumerate(self.shards):
            if shard is not None and shard.element_size() < 4:
                self._widened[index] = shard.dtype
                self.shards[index] = shard.float()
        torch._foreach_mul_([shard for shard in self.shards if shard is not None], factor)

    def clear(self, set_to_none: bool) -> None:
        if set_to_none:
            self.shards = [None] * len(self.shards)
        else:
            for index, shard in enumerate(self.shards):
                if index in self._widened:  # the next round sums in the reduce dtype, as a fresh one does
                    self.shards[index] = torch.zeros_like(shard, dtype=self._widened[index])
                elif shard is not None:
                    shard.zero_()
        self._widened = {}

    @property
    def has_gradients(self) -> bool:
        return any(shard is not None for shard in self.shards)

    def device_tensors(self) -> list[torch.Tensor]:
        return [s for s in self.shards if s is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def accumulating(self) -> ContextManager[None]:  # the shards sum on the device anyway
        return contextlib.nullcontext()


class ShardFill(enum.Enum):
    """What one bucket's host gradient shard holds since the last ``clear()``."""

    EMPTY = "empty"  # no gradient (``ready()`` gives None)
    FILLED = "filled"  # the sum of the reductions since clear(): the next one adds to it
    ZEROED = "zeroed"  # a zero gradient kept by zero_grad(set_to_none=False): the next reduction overwrites it


class HostGradientShards:
    """After :meth:`ready`, the host shards hold every gradient reduced since :meth:`clear`, summed in reduction order,
    with no host copy in flight. Host syncs: one per step (:meth:`ready`), plus one per bucket per later micro-batch
    outside :meth:`accumulating`."""

    def __init__(self, device: torch.device, shards: list[torch.Tensor], timeout: Optional[float] = None):
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copy stream
        self._timeout = timeout  # bounds the wait for the copies (which wait for the reduce-scatters)
        self.shards = shards  # per bucket: zeroed, shard-sized, in the master's dtype (page-locked on CUDA)
        self._fill = [ShardFill.EMPTY] * len(shards)  # per bucket: what the host shard holds
        self._device_sums: list[Optional[torch.Tensor]] = [None] * len(shards)  # device accumulators
        self._copying = False  # a copy was queued since the last wait
        self._accumulating = False  # inside accumulating(): keep the sums on the device

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Mark non-final micro-batches: their reductions sum on the device and cross to the host once, at the
        first reduction outside the block (or at ``ready()``)."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def add(self, bucket_index: int, reduced: torch.Tensor) -> None:
        """Take one reduction of a bucket (``reduced``: device, reduce dtype), issued in the current stream."""
        device_sum = self._device_sums[bucket_index]
        self._device_sums[bucket_index] = reduced if device_sum is None else device_sum.add_(reduced)
        if not self._accumulating:
            self._to_host(bucket_index)

    def _to_host(self, bucket_index: int) -> None:
        """Move the bucket's device sum (set: :meth:`add` left it there) to its host shard; the sum is cleared first."""
        reduced, self._device_sums[bucket_index] = self._device_sums[bucket_index], None
        host = self.shards[bucket_index]
        if self._fill[bucket_index] is ShardFill.FILLED:
            self.wait_copies()  # a micro-batch not marked accumulating: sum on the host (blocking)
            host.add_(reduced.to(host.device))
            return
        if self._stream is None:
            host.copy_(reduced)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(reduced.device))
            with torch.cuda.stream(self._stream):
                host.copy_(reduced, non_blocking=True)
            reduced.record_stream(self._stream)  # the allocator must not reuse it before the copy has run
            self._copying = True
        self._fill[bucket_index] = ShardFill.FILLED  # (a ZEROED shard is overwritten)

    def wait_copies(self) -> None:
        """Block until no gradient copy to the host is in flight; then the host shards may be read or written."""
        if self._copying:
            comm.wait_for_stream(self._stream, self._timeout, "gradient copies to the host")
            self._copying = False

    def ready(self) -> list[Optional[torch.Tensor]]:
        """Every gradient on the host, every copy finished: the host shards, ``None`` where no gradient came."""
        for index, device_sum in enumerate(self._device_sums):
            if device_sum is not None:  # accumulating() was still on at step: move the sum over now
                self._to_host(index)
        self.wait_copies()
        return [None if fill is ShardFill.EMPTY else shard for shard, fill in zip(self.shards, self._fill)]

    def unscale(self, factor: float) -> None:
        """Multiply every shard by ``factor`` (the loss scale's inverse), on the host, in the master's dtype."""
        torch._foreach_mul_([shard for shard in self.ready() if shard is not None], factor)

    def clear(self, set_to_none: bool) -> None:
        self._device_sums = [None] * len(self.shards)
        if set_to_none:
            self._fill = [ShardFill.EMPTY] * len(self.shards)
        else:  # as on the device: gradients that existed become zeros, and the next reduction replaces them
            self.wait_copies()
            for index, shard in enumerate(self.shards):
                if self._fill[index] is not ShardFill.EMPTY:
                    shard.zero_()
                    self._fill[index] = ShardFill.ZEROED

    @property
    def has_gradients(self) -> bool:
        return any(fill is not ShardFill.EMPTY for fill in self._fill) or bool(self.device_tensors())

    def device_tensors(self) -> list[torch.Tensor]:
        return [s for s in self._device_sums if s is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.shards)
