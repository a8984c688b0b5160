"""Gradient reduction: from each rank's full ``param.grad`` to the averaged gradient shard it owns.

Tensors named here (all 1-D):

* ``bucket buffer`` -- ``bucket.padded_numel`` elements in the reduce dtype; holds ``grad / world_size`` (every
  rank of the topology: with hybrid sharding, shard size times replicas) of every bucket member (zero for
  members without a gradient and for the padding). Lives only from the first gradient of the bucket until its
  reduce-scatter has finished.
* ``reduced`` -- ``bucket.shard_numel`` elements in the reduce dtype: this rank's part of one reduction
  of the averaged gradient (at world size 1, the bucket buffer itself; with hybrid sharding, all-reduced
  across the replicas once its reduce-scatter in the shard group has finished, that all-reduce in flight
  while backward goes on, as the reduce-scatters are), handed to the gradient store
  (:mod:`zeroimpl.grad_shards`), which sums the reductions since the last ``zero_grad()`` on the device
  or, with offload, on the host.

With ``quantize_grad_reduce`` each reduce-scatter sends 8-bit payloads instead
(:func:`zeroimpl.comm.reduce_scatter_quantized`, blocks of :mod:`zeroimpl.quantized_comm`): the same buffers,
the same order, ``reduced`` summed in fp32 by its owner.

Stage 1 keeps gradients in ``param.grad`` during backward and reduces all buckets once, when the optimizer
needs them (``finalize()``): one reduce-scatter per step however many micro-batches were accumulated.

Stage 2 reduces during backward. A post-accumulate-grad hook copies the gradient into its bucket buffer
and frees ``param.grad``; buckets are *launched strictly in bucket order*, so every rank issues the same
collectives in the same order whatever order its hooks fire in. At the end of backward (an autograd
callback) the buckets not yet launched -- those with unused parameters -- are launched with zeros, and
every reduction is waited for, so no bucket buffer survives backward::

    compute: --grad b0--|--grad b1--|--grad b2--|
    comm:               |--RS b0----|--RS b1----|--RS b2--|  (at most `max_inflight` in flight)
    hybrid:                         |--AR b0----|--AR b1----|--AR b2--|  (across replicas; as many)

A *round* is what one backward pass reduces: each bucket once (:mod:`zeroimpl.backward_round` says when
one ends, also under reentrant activation checkpointing, and in which order buckets launch). A round still
open when the optimizer needs the gradients, or when a new backward starts, is closed then. A backward that
failed part-way leaves its round open too; its gradients are kept, as torch keeps the ``.grad`` that a failed
backward had already accumulated.

Besides the values, the reducer records which parameters received a gradient since the last
``zero_grad()`` or step (``grad_exists``), so that parameters without one are not stepped, as in torch.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Optional, Union

import torch

from . import comm
from .backward_round import BackwardRound, LaunchOrder, under_compiled_autograd
from .buffers import BucketStorage
from .layout import ShardLayout
from .memory_format import shaped
from .quantized_comm import reduction_blocks
from .ownership import rebound_message
from .step_state import StepState
from .streams import WorkStream, on_work_stream
from .topology import Topology

if TYPE_CHECKING:
    from .grad_shards import DeviceGradientShards
    from .offload import HostGradientShards
    from .uneven import UnevenInputs


class _Reduction:
    """One bucket's reduce-scatter in flight (or, hybrid, its reduced shard's all-reduce: no buffer)."""

    def __init__(self, bucket_index: int, buffer: Optional[torch.Tensor], output: torch.Tensor, work):
        self.bucket_index = bucket_index
        self.buffer = buffer  # kept alive until the collective finishes
        self.output = output
        self.work = work


class GradientReducer:
    """Owns the hooks and the bucket buffers of one ShardedOptimizer; hands reductions to ``gradients``."""

    def __init__(self, layout: ShardLayout, storages: list[BucketStorage], topology: Topology,
                 stage: int, reduce_dtype: Optional[torch.dtype], max_inflight: int,
                 gradients: Union[DeviceGradientShards, HostGradientShards], step_state: StepState,
                 uneven: "UnevenInputs", timeout: Optional[float] = None, quantized: Union[bool, str] = False):
        self.layout = layout
        self.timeout = timeout  # seconds a reduce-scatter may take before CollectiveError (None: the group's)
        self.storages = storages
        self.group = topology.shard  # reduce-scatters
        self.replicate = topology.replicate  # all-reduces of the reduced shards (hybrid sharding), or None
        self.stage = stage
        # per bucket: the given dtype, or fp32 (fp64 for fp64 parameters)
        self.reduce_dtypes = [reduce_dtype or torch.promote_types(s.param_buffer.dtype, torch.float32) for s in storages]
        self.max_inflight = max_inflight
        self.step_state = step_state  # told of every gradient arrival (misuse checks)
        self.uneven = uneven  # checked in before each stage-2 round of reduce-scatters (torch's Join)
        self._scale = 1.0 / topology.world_size
        self.gradients = gradients  # where finished reductions go
        self.streams = WorkStream(storages[0].param_buffer.device if storages else "cpu")  # GPU work in host order

        self._inflight: deque[_Reduction] = deque()  # reduce-scatters, in launch order
        self._replicating: deque[_Reduction] = deque()  # hybrid: reduced shards' all-reduces, in the same order
        self.backward_passes = 0  # backward passes that reached these parameters since the last step/zero_grad
        self.round = BackwardRound()
        num_params = len(layout.slots)
        self.grad_exists = [False] * num_params  # by parameter index: a gradient arrived since the last clear
        self._consumed = [False] * num_params  # grad_exists when the last step consumed the gradients
        self._grad_versions: dict[int, int] = {}  # stage 1: param index -> its .grad's version when it arrived
        self._buffers: list[Optional[torch.Tensor]] = [None] * len(layout.buckets)
        self._padding = [layout.padding(bucket.index) for bucket in layout.buckets]  # zeroed in every buffer
        self._order = LaunchOrder([bucket.param_indices for bucket in layout.buckets])
        # quantized: per bucket, the blocks its 8-bit reduce-scatter sends on, and those of its shard's 8-bit
        # all-reduce across replicas (or None: not quantized)
        self._blocks, self._replica_blocks = reduction_blocks(layout, quantized, topology.shard_rank, topology.replica)

        self._bucket_of = {}  # id(param) -> (bucket index, param index)
        self._strides: dict[int, tuple] = {}  # param index -> the strides of its view of the bucket buffer
        self._handles = []
        hook = _forward_to(weakref.ref(self))  # holds the reducer weakly: a deleted optimizer lets go of the model
        for storage in storages:
            for index, param in zip(storage.bucket.param_indices, storage.params):
                self._bucket_of[id(param)] = (storage.bucket.index, index)
                self._strides[index] = param.stride()  # its memory format: the gradient slot's too
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        weakref.finalize(self, _remove_handles, self._handles)

    # -- hooks ----------------------------------------------------------------------------------
    @on_work_stream(joined=False)  # the compute streams do not wait for the reduction during backward
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket_index, param_index = self._bucket_of[id(param)]
        problem = self._refused(param, bucket_index, param_index)
        if problem is not None:
            self._reset_round()  # no reduction of this backward may stay in flight behind the error
            raise RuntimeError(problem)
        self.step_state.gradient_arrived()
        self._follow_backward()
        if self.stage == 1:
            self._grad_versions[param_index] = param.grad._version
            return
        self.grad_exists[param_index] = True
        if self._order.seen(bucket_index, param_index):
            # a second gradient in one round: reentrant checkpointing whose outer backward we could not see
            # end, or a parameter shared by two checkpointed segments. Close the round and start another.
            self._close_round()
            self._follow_backward()
        self._write_grad(bucket_index, param_index, param.grad)
        param.grad = None
        for ready in self._order.arrive(bucket_index, param_index):
            self._launch(ready)

    def _refused(self, param: torch.Tensor, bucket_index: int, param_index: int) -> Optional[str]:
        """Why this gradient cannot be taken, or None."""
        if under_compiled_autograd():
            return ("ShardedOptimizer does not support compiled autograd (torch._dynamo.config.compiled_autograd): "
                    "its gradient hooks reduce-scatter during backward. Compile the model's forward "
                    "(torch.compile(model)) and run backward without compiled autograd")
        if param.grad.is_sparse:
            return ("ShardedOptimizer got a sparse gradient; sparse gradients cannot be sharded. Use dense "
                    "embeddings (e.g. nn.Embedding(sparse=False)).")
        if not self.storages[bucket_index].holds(param_index, param):
            return rebound_message([param_index], param, self.storages[bucket_index].param_buffer)
        return None

    def _follow_backward(self) -> None:
        """Make sure that the end of the backward now running closes the round (after closing one that a failed
        backward or close left open); in stage 2, check in (torch's Join) before a round's reduce-scatters."""
        if self.round.interrupted():
            self._close_round()  # keep what it reduced, as torch keeps .grad
        if self.stage == 2 and self.round.idle:
            self.uneven.check_in()
        self.round.follow(_weakly_end_of_backward(weakref.ref(self)))

    def _end_of_backward(self) -> None:
        if self.round.ended():  # else a reentrant checkpoint's nested backward: the outer one goes on (no join)
            with self.streams.span():
                self._close_round()

    def _close_round(self) -> None:
        """Stage 2: launch what is left, in order; wait for everything, and count the backward pass."""
        if self.stage == 2:
            self._launch_remaining()
        self._reset_round()
        self.backward_passes += 1  # (after the waits: a close that raised is tried again, and counted once)

    def _launch_remaining(self) -> None:
        """Launch every bucket of the round not launched yet, in order: each rank issues every bucket's
        collective once per round that began, as the other ranks do, also for a round discarded after an error."""
        for bucket_index in self._order.remaining():
            self._launch(bucket_index)

    def _reset_round(self) -> None:
        """Wait for every reduction and forget the per-round state."""
        self.wait_all()
        self.round.reset()
        self._order.reset()
        self._buffers = [None] * len(self._buffers)

    # -- buckets --------------------------------------------------------------------------------
    def _buffer(self, bucket_index: int) -> torch.Tensor:
        """The bucket's reduction buffer of this round: ``padded_numel`` elements, born with zero padding (it is
        reduce-scattered into a gradient shard, whose norm must not see garbage); slots written or zeroed later."""
        if self._buffers[bucket_index] is None:
            storage = self.storages[bucket_index]
            buffer = torch.empty(storage.bucket.padded_numel, dtype=self.reduce_dtypes[bucket_index],
                                 device=storage.param_buffer.device)
            for start, end in self._padding[bucket_index]:
                buffer[start:end].zero_()
            self._buffers[bucket_index] = buffer
        return self._buffers[bucket_index]

    def _write_grad(self, bucket_index: int, param_index: int, grad: torch.Tensor) -> None:
        slot, buffer = self.layout.slots[param_index], self._buffer(bucket_index)
        self.streams.use(buffer, grad)
        view = shaped(buffer[slot.offset:slot.end], grad.shape, self._strides[param_index])
        if grad.dtype == view.dtype:
            torch.mul(grad, self._scale, out=view)  # pre-divide by world size, as DDP does
        else:  # widen first: dividing a 16-bit gradient would round it in 16 bits
            view.copy_(grad)
            view.mul_(self._scale)

    def _launch(self, bucket_index: int) -> None:
        """Zero the slots no gradient wrote (the padding was zeroed at allocation), then start the bucket's
        reduce-scatter."""
        bucket = self.layout.buckets[bucket_index]
        buffer = self._buffer(bucket_index)
        self.streams.use(buffer)
        arrived = self._order.arrived(bucket_index)
        for param_index in bucket.param_indices:
            if param_index not in arrived:
                slot = self.layout.slots[param_index]
                buffer[slot.offset:slot.end].zero_()
        if not comm.issues_collectives(self.layout.world_size):  # the bucket buffer is the shard
            output = buffer
        else:
            output = torch.empty(bucket.shard_numel, dtype=self.reduce_dtypes[bucket_index], device=buffer.device)
        if self._blocks is None:
            work = comm.reduce_scatter(output, buffer, self.group, self.timeout, tag=bucket_index)
        else:
            work = comm.reduce_scatter_quantized(output, buffer, self._blocks[bucket_index], self.group,
                                                 self.timeout, tag=bucket_index)
        self._inflight.append(_Reduction(bucket_index, buffer, output, work))
        self._buffers[bucket_index] = None  # (kept until issued: a launch that raised is tried again)
        self._order.launched(bucket_index)
        while len(self._inflight) > self.max_inflight:  # bound the buffers: wait for the oldest on the host
            self._complete_oldest(on_host=buffer.is_cuda)

    def _complete_oldest(self, on_host: bool = False) -> None:
        """Finish the oldest reduce-scatter and hand its shard to the store; with hybrid sharding start the
        shard's all-reduce across the replicas instead, finished later (:meth:`_complete_replicated`).
        ``on_host``: block the host, not the compute stream, until the collective is done (CUDA)."""
        while self._replicating and self._replicating[0].work.landing:  # (its 8-bit all-gather raised: first, in
            self._complete_replicated()  # the order of the other ranks, before another collective across replicas)
        reduction = self._inflight[0]  # taken off once handed on: one that raised (out of memory) is done again
        # before the wait, which lets go of the work's buffers and queues the 8-bit sum that reads them
        self.streams.use(reduction.buffer, reduction.output, *reduction.work.buffers)
        (reduction.work.wait_on_host if on_host else reduction.work.wait)()
        if self.replicate is None:
            self.gradients.add(reduction.bucket_index, reduction.output)
            self._inflight.popleft()
            return
        if self._replica_blocks is None:
            work = comm.all_reduce(reduction.output, torch.distributed.ReduceOp.SUM, self.replicate, self.timeout,
                                   "gradient shard all-reduce across replicas")
        else:
            work = comm.all_reduce_quantized(reduction.output, self._replica_blocks[reduction.bucket_index],
                                             self.replicate, self.timeout, tag=reduction.bucket_index)
        self._replicating.append(_Reduction(reduction.bucket_index, None, reduction.output, work))
        self._inflight.popleft()
        while len(self._replicating) > self.max_inflight:
            self._complete_replicated()

    def _complete_replicated(self) -> None:
        reduction = self._replicating[0]
        self.streams.use(reduction.output, *reduction.work.buffers)
        # as for the reduce-scatters: on CUDA block the host, not the compute stream
        (reduction.work.wait_on_host if reduction.output.is_cuda else reduction.work.wait)()
        self.gradients.add(reduction.bucket_index, reduction.output)
        self._replicating.popleft()

    def wait_all(self) -> None:
        while self._inflight:
            self._complete_oldest()
        while self._replicating:
            self._complete_replicated()

    # -- the optimizer's verbs ------------------------------------------------------------------
    @on_work_stream()
    def close_left_open(self) -> None:
        """Close a round left open by a reentrant backward, or by a backward or close that failed part-way (before
        any other collective: the other ranks issued its reduce-scatters at the end of their backward)."""
        if self.round.left_open():
            self._close_round()

    @on_work_stream()
    def finalize(self) -> None:
        """Hand every gradient produced so far to the gradient store (stage 1: reduce ``param.grad`` now); after
        :meth:`close_left_open` (``StepChecks.prepare`` calls it first, before the check-in)."""
        self.wait_all()
        with_grad = [p for s in self.storages for p in s.params if p.grad is not None]
        if self.stage == 2 and with_grad:
            raise RuntimeError("stage 2 reduces gradients during backward, so a param.grad set outside zeroimpl's "
                               "backward hooks would be ignored. If the model is wrapped in DistributedDataParallel, "
                               "unwrap it (DDP writes all-reduced gradients back; ShardedOptimizer reduces them "
                               "itself); if you set param.grad by hand or with torch.autograd.grad, use stage=1")
        if self.stage == 1 and (with_grad or self._order.begun()):  # (begun: a finalize that raised part-way)
            self._check_grads_unedited()
            for storage in self.storages:
                bucket_index = storage.bucket.index
                for param_index, param in zip(storage.bucket.param_indices, storage.params):
                    if param.grad is not None:
                        self._write_grad(bucket_index, param_index, param.grad)
                        self._order.arrive(bucket_index, param_index)
                        self.grad_exists[param_index] = True
                        param.grad = None  # freed as copied: the bucket buffers replace the gradients
                for launchable in self._order.through(bucket_index):  # this bucket, complete or not
                    self._launch(launchable)
            self._reset_round()
        self.streams.hand_over(*self.gradients.device_tensors())  # the step reads them next

    def _check_grads_unedited(self) -> None:
        """Stage 1 reduces ``param.grad`` at the step: an in-place edit since backward of a local gradient (kept
        by a hook: ``.grad`` itself is a view of the average after backward) would act on this rank's alone."""
        edited = [i for s in self.storages for i, p in zip(s.bucket.param_indices, s.params)
                  if p.grad is not None and i in self._grad_versions and p.grad._version != self._grad_versions[i]]
        if edited:
            self.zero_grad()
            raise RuntimeError(
                f"the local gradient of {len(edited)} parameter(s) was modified in place between backward and step "
                "(a reference kept from a hook during backward). Stage 1 averages the gradients only at the step, "
                "so the edit would act on this rank's local gradient, not on the average as with DDP. Edit "
                "param.grad after backward instead (it is a view of the averaged gradient: torch's clip_grad_norm_, "
                "clip_grad_value_ and in-place scaling work on it), or scale the loss. The gradients were cleared; "
                "nothing was updated")

    def forget(self, param_indices: list[int]) -> None:
        """These parameters' gradients were cleared by the user: they have none since the last step."""
        for index in param_indices:
            self.grad_exists[index] = False
            self._consumed[index] = False

    def end_step(self, stepped: Optional[list[bool]] = None) -> None:
        """The optimizer step consumed this step's gradients (as ``zero_grad()`` would clear them): count
        backward passes afresh and forget which parameters had a gradient, remembering those the step
        stepped (``stepped``, agreed across ranks; ``None``: all) for ``zero_grad(set_to_none=False)``."""
        self.backward_passes = 0
        self._consumed = list(stepped) if stepped is not None else [True] * len(self.grad_exists)
        self.grad_exists = [False] * len(self.grad_exists)
        self._grad_versions.clear()

    def live_buffers(self) -> list[torch.Tensor]:
        """Bucket buffers and reduction outputs alive right now (for memory accounting)."""
        live = [b for b in self._buffers if b is not None]
        for reduction in self._inflight:
            live += [reduction.buffer, reduction.output, *reduction.work.buffers]
        return live + [t for reduction in self._replicating for t in (reduction.output, *reduction.work.buffers)]

    @on_work_stream()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: ``set_to_none`` forgets the gradients; otherwise every parameter that had a gradient
        (now, or when the last step consumed it) keeps a zero gradient, and is stepped with it."""
        with_grad = [p for storage in self.storages for p in storage.params if p.grad is not None]
        self.streams.use(*(p.grad for p in with_grad), *self.gradients.device_tensors())  # (from other streams)
        for param in with_grad:
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()
        if self.round.left_open() if self.stage == 2 else self._order.begun():
            self._launch_remaining()  # (a round that raised part-way)
        self._reset_round()
        self.backward_passes = 0
        self._grad_versions.clear()
        if set_to_none:
            self.grad_exists = [False] * len(self.grad_exists)
        else:
            self.grad_exists = [now or then for now, then in zip(self.grad_exists, self._consumed)]
        self._consumed = [False] * len(self._consumed)
        self.gradients.clear(set_to_none)


def _weakly_end_of_backward(reducer_ref):
    """The end-of-backward callback, holding the reducer weakly (a deleted optimizer lets go of the model)."""
    def on_end():
        reducer = reducer_ref()
        if reducer is not None:
            reducer._end_of_backward()
    return on_end


def _forward_to(reducer_ref):
    def hook(param):
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(param)
    return hook


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()
