"""From the updated master weights to every rank's parameters: master -> (staging) -> parameter shard ->
all-gather, bucket by bucket.

Per bucket (1-D tensors of :mod:`zeroimpl.buffers`): the master (fp32, on the host with offload) is written into
this rank's ``shard`` of the ``param_buffer``, and the bucket's all-gather is queued at once, so that it
overlaps the next bucket's copy. With offload the step drives the pipeline one bucket at a time -- its host
step, then :meth:`ParamSync.publish` -- so that a bucket's host step overlaps the copy and all-gather of the one
before. A 16-bit model's host masters are converted on the host into one of two page-locked *staging* buffers
of its dtype (taken in turn, a buffer refilled once its previous copy has run), so that half the bytes cross
to the device. The gathers are left in flight into the next forward (``overlap_param_gather``), guarded by
:mod:`zeroimpl.inflight`. On the CPU every copy is synchronous; the code path is the same::

    host   : |step b0|step b1|step b2|
    copy   :         |H2D b0 |H2D b1 |H2D b2|
    comm   :                 |AG b0  |AG b1 |AG b2|  -> left in flight into the next forward
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from . import comm
from .buffers import BucketStorage
from .host_memory import device_tensor
from .inflight import InFlightGathers
from .pending import Pending


class ParamSync:
    """Publishes one optimizer's master weights into the parameters and all-gathers them.

    Args:
        storages: the buckets' parameter memory.
        group, timeout: the shard group (the all-gathers run there) and the collectives' timeout.
        staging: offload of a 16-bit model: per 16-bit dtype, two host buffers of that dtype's largest shard
            (:func:`zeroimpl.offload.host_buffers`); empty otherwise.

    Invariant: between :meth:`begin` and :meth:`end` every published bucket's all-gather is queued; after
    :meth:`finish` the parameters hold the published values; after :meth:`wait_copies` no copy reads the
    masters or the staging buffers.
    """

    def __init__(self, storages: list[BucketStorage], group, timeout: Optional[float],
                 staging: dict[torch.dtype, list[torch.Tensor]]):
        self.storages, self.group, self.timeout, self.staging = storages, group, timeout, staging
        self._payloads: dict[int, torch.Tensor] = {}  # quantized: bucket index -> its gathered payloads in flight
        device = storages[0].param_buffer.device
        self._cuda = device if device.type == "cuda" else None  # copies to CUDA are asynchronous: track them
        self.gathers = InFlightGathers()  # the all-gathers left in flight by the last step
        self._pending: dict = {}  # bucket index -> its all-gather, between begin() and end()
        self._turns = dict.fromkeys(staging, 0)  # per dtype: the staging buffer to fill next
        self._staged: dict = {}  # (dtype, 0 or 1) -> the CUDA event after the last copy out of that buffer
        self._published: Optional[torch.cuda.Event] = None  # after the last copy of masters to the device
        weakref.finalize(self, self.gathers.abandon)  # no gather outlives its optimizer unfinished, no guard stays

    def begin(self, overrule_edits: bool = True) -> None:
        """Before the first bucket (and before the masters are stepped): the previous step's gathers and copies
        must have finished with the parameters and the masters. ``overrule_edits``: see :meth:`_overrule_edits`
        (an exact publish of every bucket overrules them anyway)."""
        self.finish()
        self.wait_copies()
        self._pending = {}
        self._turns = dict.fromkeys(self.staging, 0)
        if overrule_edits:
            self._overrule_edits()

    def _overrule_edits(self) -> None:
        """With a quantized all-gather, before its steps are sent: where any rank has seen a member of a bucket
        written outside the optimizer (``BucketStorage.edited``), every rank takes every owner's shard of that
        bucket exactly (each owner's master has taken the edits of its own shard), so that an edit made on some
        ranks only -- which the next step's change, added on every rank, would carry on -- is overruled by the
        owner's values, as an unquantized all-gather overrules it. Collective: one small all-reduce per step."""
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

    def publish(self, storage: BucketStorage) -> None:
        """Write the bucket's master into its shard of the parameters and queue its all-gather."""
        if storage.blocks is not None:  # quantized: 8-bit payloads of the masters (zeroimpl.quantized_comm)
            self._pending[storage.bucket.index] = self._gather_quantized(storage)
            return
        self._publish_master(storage)
        self._pending[storage.bucket.index] = self._gather_exactly(storage)

    def _publish_master(self, storage: BucketStorage) -> None:
        """Write the bucket's master into its shard of the parameters, through a staging buffer where there is one."""
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
                self._staged[key] = torch.cuda.Event()
                self._staged[key].record(torch.cuda.current_stream(self._cuda))

    def _gather_exactly(self, storage: BucketStorage) -> Pending:
        """Queue the unquantized all-gather of every rank's shard of the bucket's parameters."""
        return comm.all_gather(storage.param_buffer, storage.shard, self.group, self.timeout, tag=storage.bucket.index)

    def _gather_quantized(self, storage: BucketStorage) -> Pending:
        """Queue the all-gather of every rank's 8-bit payload of the step from its published shard to its master;
        when it lands, every rank adds each rank's decoded step to that rank's shard of the parameters (written
        past the parameters' version counters, as a gather's own write is: :meth:`end` counts it)."""
        blocks, index = storage.blocks, storage.bucket.index
        size = blocks.payload_bytes
        gathered = torch.empty(len(blocks.segments) * size, dtype=torch.uint8, device=storage.param_buffer.device)
        # on the parameters' device: a host master (offload) crosses as it would unquantized, queued on the stream
        master = storage.master.to(storage.published.device, non_blocking=True)
        own = blocks.encode(master - storage.published.to(master.dtype),
                            out=gathered[blocks.rank * size:(blocks.rank + 1) * size])
        self._payloads[index] = gathered
        parameters, landed = storage.param_buffer.data, []

        def land() -> None:  # run again after raising (Pending.wait): from the first rank not yet added
            payload = self._payloads[index]
            for rank in range(len(landed), len(blocks.segments)):
                blocks.add_decoded(payload, parameters, range(rank, rank + 1))
                landed.append(rank)
            del self._payloads[index]
            if payload.is_cuda:  # decoded on the waiting stream, which may not be the one that allocated it
                payload.record_stream(torch.cuda.current_stream(payload.device))
            storage.mark_published()
        return comm.all_gather(gathered, own, self.group, self.timeout, tag=index, then=land)

    def live_buffers(self) -> list[torch.Tensor]:
        """The gathered payloads of quantized all-gathers still in flight."""
        return list(self._payloads.values())

    def end(self, defer: bool) -> None:
        """After the last bucket: record the copies, mark the masters in sync, and hand the gathers to
        :class:`~zeroimpl.inflight.InFlightGathers` (``defer``: leave them in flight; else wait now)."""
        if self._cuda is not None:
            self._published = torch.cuda.Event()
            self._published.record(torch.cuda.current_stream(self._cuda))
        # the all-gather writes the parameters in place: let autograd refuse graphs built before it
        torch.autograd.graph.increment_version([p for s in self.storages for p in s.params])
        for storage in self.storages:
            storage.mark_master_in_sync()
        self.gathers.start(self._pending, {s.bucket.index: s.param_buffer for s in self.storages},
                           {s.bucket.index: s.params for s in self.storages}, guard=defer)
        self._pending = {}

    def publish_all(self, defer: bool = False) -> None:
        """Every bucket, in order."""
        self.begin()
        for storage in self.storages:
            self.publish(storage)
        self.end(defer)

    def publish_exactly(self, shards: Optional[list[torch.Tensor]] = None) -> None:
        """Every bucket all-gathered unquantized (a checkpoint restores the parameters exactly): where the
        all-gather is quantized, from ``shards`` (per bucket, this rank's shard of the parameters as saved) when
        given; else from the masters. Waits."""
        self.begin(overrule_edits=False)
        for index, storage in enumerate(self.storages):
            if shards is not None and storage.blocks is not None:
                storage.shard.copy_(shards[index])
            else:
                self._publish_master(storage)
            self._pending[storage.bucket.index] = self._gather_exactly(storage)
        self.end(defer=False)
        for storage in self.storages:
            storage.mark_published()
            storage.edited = False

    def finish(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the all-gathers still in flight: of ``buckets``, or of every bucket."""
        self.gathers.finish(buckets)

    def wait_copies(self) -> None:
        """Block until no copy of masters (or staging buffers) to the device is in flight: the masters may then
        be written."""
        for event in self._staged.values():
            event.synchronize()
        self._staged.clear()
        if self._published is not None:
            self._published.synchronize()
            self._published = None

    def sync_masters(self) -> None:
        """Take parameters edited outside the optimizer into the masters (after the gathers and copies)."""
        self.finish()
        self.wait_copies()
        for storage in self.storages:
            storage.sync_master_with_params()
