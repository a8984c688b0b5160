"""From the updated master weights to every rank's parameters, bucket by bucket: master -> (staging) -> this rank's
``shard`` of the ``param_buffer`` (:mod:`zeroimpl.buffers`) -> all-gather, queued at once to overlap the next bucket's
copy. With offload the step drives it one bucket at a time (``step_bucket``), so that a bucket's host step overlaps the
copy and all-gather of the one before (diagram: :mod:`zeroimpl.offload`); a 16-bit model's host masters are converted on
the host into one of two page-locked *staging* buffers of its dtype, taken in turn, so that half the bytes cross. The
gathers are left in flight into the next forward (``overlap_param_gather``), guarded by :mod:`zeroimpl.inflight`."""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from . import comm
from .buffers import BucketStorage
from .host_memory import device_tensor
from .inflight import BucketGather, InFlightGathers
from .pending import Pending
from .topology import Topology


class ParamSync:
    """One optimizer's ``storages``, synced in ``topology``'s shard group once per step: :meth:`start_param_sync`, then
    :meth:`finish_param_sync`. ``staging``: a 16-bit model's two host buffers per dtype under offload, else empty.
    Invariant: after the start every bucket's all-gather is issued (waited for, or left in :attr:`gathers`, guarded);
    after a finish of all buckets the parameters hold the published values, and no copy reads masters or staging."""

    def __init__(self, storages: list[BucketStorage], topology: Topology,
                 staging: dict[torch.dtype, list[torch.Tensor]]):
        self.storages, self.staging = storages, staging
        self.group, self.timeout = topology.shard, topology.timeout
        self._gathers_issued = comm.issues_collectives(dist.get_world_size(self.group))  # (at one rank: in place)
        device = storages[0].param_buffer.device
        self._cuda = device if device.type == "cuda" else None  # copies to CUDA are asynchronous: track them
        self.gathers = InFlightGathers()  # the all-gathers left in flight by the last step
        self._turns = dict.fromkeys(staging, 0)  # per dtype: the staging buffer to fill next
        # the CUDA event after the last copy out of a host buffer: staging (dtype, 0 or 1), the masters (None)
        self._staged: dict = {}
        weakref.finalize(self, self.gathers.abandon)  # no gather outlives its optimizer unfinished, no guard stays

    def start_param_sync(self, step_bucket: Optional[Callable[[BucketStorage], None]] = None, overlap: bool = False,
                         exact: bool = False, saved_shards: Optional[list[torch.Tensor]] = None) -> None:
        """Collective (shard group): finish the previous round, then write every bucket's master into its shard of the
        parameters and issue its all-gather, in bucket order. ``step_bucket(storage)``: run just before a bucket is
        published (offload). ``overlap``: leave the gathers in flight, guarded. ``exact`` (state load): gather every
        bucket unquantized, a quantized bucket's shard from ``saved_shards`` (this rank's, as saved) if given, else from
        its master; else edits made on some ranks only are first overruled (:meth:`_overrule_edits`)."""
        self.finish_param_sync()
        self._turns = dict.fromkeys(self.staging, 0)
        if not exact:
            self._overrule_edits()
        gathers = {}
        for storage in self.storages:
            if step_bucket is not None:
                step_bucket(storage)
            if storage.blocks is not None and not exact:  # 8-bit payloads of the steps (zeroimpl.quantized_comm)
                gathers[storage.bucket.index] = self._gather_quantized(storage)
                continue
            if saved_shards is not None and storage.blocks is not None:
                storage.shard.copy_(saved_shards[storage.bucket.index])
            else:
                self._publish_master(storage)
            if exact:
                storage.mark_published()
                storage.edited = False
            gathers[storage.bucket.index] = BucketGather(self._gather_exactly(storage))
        if self._cuda is not None:
            self._staged[None] = torch.cuda.current_stream(self._cuda).record_event()
        # the all-gather writes the parameters in place: let autograd refuse graphs built before it
        torch.autograd.graph.increment_version([p for s in self.storages for p in s.params])
        for storage in self.storages:
            storage.mark_master_in_sync()
        self.gathers.start(gathers, {s.bucket.index: s.param_buffer for s in self.storages},
                           {s.bucket.index: s.params for s in self.storages}, guard=overlap)

    def finish_param_sync(self, buckets: Optional[Iterable[int]] = None, take_edits: bool = False) -> None:
        """Wait for the all-gathers in flight of ``buckets`` (``None``: all, then every copy out of the masters and
        staging buffers, so that they may be written). ``take_edits``: then take parameters written outside the
        optimizer into the masters."""
        self.gathers.finish(buckets)
        if buckets is None:
            for event in self._staged.values():
                event.synchronize()
            self._staged.clear()
        if take_edits:
            for storage in self.storages:
                storage.sync_master_with_params()

    def _overrule_edits(self) -> None:
        """Collective (one small all-reduce): where any rank saw a member of a quantized bucket written outside the
        optimizer (``BucketStorage.edited``), all-gather the bucket exactly (each owner's master took its shard's
        edits); else an edit made on some ranks only would persist, the next 8-bit deltas added on top of it."""
        quantized = [s for s in self.storages if s.blocks is not None]
        if not quantized:
            return
        edited = device_tensor([float(s.edited) for s in quantized], quantized[0].param_buffer.device, torch.float32)
        comm.all_reduce_(edited, torch.distributed.ReduceOp.MAX, self.group, self.timeout, "edit agreement",
                         read_on_host=True)
        for storage, flag in zip(quantized, edited.tolist()):
            if flag:
                self._gather_exactly(storage).wait()
                storage.mark_published()
            storage.edited = False

    def _publish_master(self, storage: BucketStorage) -> None:
        """:meth:`BucketStorage.publish_master`, through the next staging buffer of its dtype where there is one."""
        buffers = self.staging.get(storage.shard.dtype) if storage.has_separate_master else None
        if buffers is None:
            storage.publish_master()
        else:
            dtype = storage.shard.dtype
            key = (dtype, self._turns[dtype])
            self._turns[dtype] = 1 - key[1]
            if key in self._staged:
                self._staged.pop(key).synchronize()
            storage.publish_master(buffers[key[1]][:storage.shard.numel()])
            if self._cuda is not None:
                self._staged[key] = torch.cuda.current_stream(self._cuda).record_event()

    def _gather_exactly(self, storage: BucketStorage) -> Pending:  # unquantized
        if not self._gathers_issued:  # one rank: the shard is the whole buffer
            return Pending([], "parameter all-gather", self.timeout)
        return comm.all_gather(storage.param_buffer, storage.shard, self.group, self.timeout, tag=storage.bucket.index)

    def _gather_quantized(self, storage: BucketStorage) -> BucketGather:
        """Issue the all-gather of every rank's 8-bit step (its master minus its published shard); on landing each
        decoded step is added to its rank's shard of the parameters, past the version counters as any gather's
        write (:meth:`start_param_sync` counts it). A landing that raises (out of memory) fails it for good."""
        blocks, index = storage.blocks, storage.bucket.index
        size = blocks.payload_bytes
        gathered = torch.empty(len(blocks.segments) * size, dtype=torch.uint8, device=storage.param_buffer.device)
        # on the parameters' device: a host master (offload) crosses as it would unquantized, queued on the stream
        master = storage.master.to(storage.published.device, non_blocking=True)
        own = blocks.encode(master, minus=storage.published, out=gathered[blocks.rank * size:(blocks.rank + 1) * size])
        parameters = storage.param_buffer.data

        def land() -> None:
            blocks.add_decoded(gathered, parameters)
            if gathered.is_cuda:  # decoded on the waiting stream, which may not be the one that allocated it
                gathered.record_stream(torch.cuda.current_stream(gathered.device))
            storage.mark_published()
        return BucketGather(comm.all_gather(gathered, own, self.group, self.timeout, tag=index, then=land), gathered)
