"""Gradient reduction: from each rank's full ``param.grad`` to the averaged gradient shard it owns, one round at a time.

A *bucket buffer* (1-D, ``bucket.padded_numel``, the reduce dtype) holds ``grad / world_size`` of every member
(world size of the whole topology, replicas included), zeros for members without a gradient and for padding, from
the bucket's first gradient until its reduce-scatter finishes. Each reduction's output (``bucket.shard_numel``; at
world size 1 the buffer itself), all-reduced across replicas under hybrid sharding, goes to the gradient store
(:mod:`zeroimpl.grad_shards`), which sums the reductions until the step or ``zero_grad()``.

Stage 1 keeps gradients in ``param.grad`` and reduces every bucket once per step, however many micro-batches (under
DistributedDataParallel: copies this rank's pieces of the averaged ``param.grad``). Stage 2 reduces during backward:
a post-accumulate-grad hook copies each gradient into its bucket buffer and frees ``param.grad``. Buckets start
*strictly in bucket order*, each once its parameters all have a gradient and every earlier bucket has started, so
that every rank issues the same collectives in the same order whatever order its hooks fire in. At the end of
backward the rest start with zeros and all finish: no bucket buffer survives backward::

    compute: --grad b0--|--grad b1--|--grad b2--|
    comm:               |--RS b0----|--RS b1----|--RS b2--|  (at most `max_inflight` in flight)
    hybrid:                         |--AR b0----|--AR b1----|--AR b2--|  (across replicas; as many)

A *round* is what one backward reduces, each bucket once. Its :class:`RoundState`:

* ``IDLE`` -> ``RUNNING`` at the first gradient, which queues an end-of-backward callback.
* ``RUNNING`` -> ``IDLE`` when the callback closes the round at the end of the outermost backward; at the end of a
  nested (reentrant checkpointing) one -> ``DEFERRED``, closed by whoever needs the gradients next. A failed
  backward drops the callback: its gradients are kept, as torch keeps ``.grad``, and the next backward, step or
  ``zero_grad()`` closes the round first.
* any -> ``FAILED`` (terminal) when zeroimpl's own work raises: this rank's collectives no longer match the
  others', so every later verb raises naming the first failure, and the other ranks raise ``CollectiveError`` at
  their next collective. An interrupt (Ctrl-C) fails the round too, once this rank has issued any of it.

Every verb (a hook, or a call of the optimizer's) is a :func:`reducer_verb`; every collective is issued through
:meth:`GradientReducer._issue` inside ``_own_work`` and kept as one :class:`InFlight` (``tests/test_house.py``).
"""

from __future__ import annotations

import enum
import functools
import sys
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, Union

import torch

from . import comm, validation
from .buffers import BucketStorage
from .grad_shards import DeviceGradientShards, HostGradientShards
from .layout import ShardLayout
from .memory_format import flattened, shaped
from .ownership import rebound_message
from .pending import CollectiveError, Pending
from .precision import at_least_fp32
from .quantized_comm import reduction_blocks
from .streams import WorkStream, on_work_stream
from .topology import Topology
from .uneven import UnevenInputs, UnevenInputsError


class RoundState(enum.Enum):
    """Where the current round (one backward pass's reductions) stands; see the module docstring."""

    IDLE = "idle"  # no gradient since the round was last closed
    RUNNING = "running"  # an end-of-backward callback was queued on a backward (dropped if that backward failed)
    DEFERRED = "deferred"  # a nested (reentrant) backward ended; the outer one may bring more gradients
    FAILED = "failed"  # zeroimpl's own work raised: every later operation raises


class InFlight(NamedTuple):
    """One bucket's collective in flight, with the tensors it needs until it finishes: its reduce-scatter
    (``buffer``: the bucket buffer it reads) or, hybrid, its shard's all-reduce across replicas (``buffer`` None)."""

    bucket_index: int
    buffer: Optional[torch.Tensor]
    output: torch.Tensor  # (shard_numel,), reduce dtype: handed to the store once finished
    work: Pending


def reducer_verb(joined: bool = True):
    """Make a method a :class:`GradientReducer` verb: refused once it has failed, run as one span of its work stream."""
    def decorate(method):
        @functools.wraps(method)
        def refused_if_failed(self, *args, **kwargs):
            if self.state is RoundState.FAILED:
                raise RuntimeError(
                    f"ShardedOptimizer cannot go on: its gradient reduction failed earlier on this rank "
                    f"({self._failure}), and its collectives are no longer those of the other ranks. Restart the job "
                    "from the last checkpoint (zeroimpl.checkpoint.load_checkpoint)")
            return method(self, *args, **kwargs)
        return on_work_stream(joined)(refused_if_failed)
    return decorate


class GradientReducer:
    """Owns the hooks, the round and the bucket buffers of one ShardedOptimizer; hands reductions to ``gradients``.
    ``max_inflight``: the most collectives of each kind in flight. ``uneven``: the ``Join`` check-in before each
    stage-2 round. ``unplaced``: why the collectives cannot reach the parameters yet, refusing every gradient."""

    def __init__(self, *, layout: ShardLayout, storages: list[BucketStorage], topology: Topology, stage: int,
                 reduce_dtype: Optional[torch.dtype], max_inflight: int,
                 gradients: Union[DeviceGradientShards, HostGradientShards], uneven: UnevenInputs,
                 quantized: Union[bool, str] = False, unplaced: Optional[str] = None):
        self.layout, self.storages, self.stage = layout, storages, stage
        self.group = topology.shard  # reduce-scatters
        self.replicate = topology.replicate  # all-reduces of the reduced shards (hybrid sharding), or None
        self.reduce_dtypes = [reduce_dtype or at_least_fp32(s.param_buffer.dtype) for s in storages]  # per bucket
        self.max_inflight, self.gradients, self.uneven = max_inflight, gradients, uneven
        self.timeout = topology.timeout
        self.unplaced = unplaced
        self._scale = 1.0 / topology.world_size
        self._in_place = not comm.issues_collectives(layout.world_size)  # the bucket buffer is the shard (one rank)
        self.streams = WorkStream(storages[0].param_buffer.device if storages else "cpu")  # GPU work in host order
        self._pieces = layout.pieces(topology.shard_rank)  # this rank's pieces of the gradient shards
        self._padding = [layout.padding(bucket.index) for bucket in layout.buckets]  # zeroed in every buffer
        self._blocks, self._replica_blocks = reduction_blocks(layout, quantized, topology.shard_rank, topology.replica)

        self.state = RoundState.IDLE
        self._callback: Optional[weakref.ref] = None  # the end-of-backward callback queued for the round
        self._failure: Optional[str] = None  # FAILED: what failed first
        self._owning = 0  # _own_work blocks open now: collectives may be issued (_issue)
        self._checking_in = False  # this round checked in under Join (its first collectives)
        self._arrived: list[set[int]] = [set() for _ in layout.buckets]  # per bucket: params whose gradient came
        self._started = 0  # buckets below this index have started their sync this round
        self._buffers: list[Optional[torch.Tensor]] = [None] * len(layout.buckets)  # buckets not started yet
        self._reducing: deque[InFlight] = deque()  # reduce-scatters, in start order
        self._replicating: deque[InFlight] = deque()  # hybrid: reduced shards' all-reduces, in the same order
        self._after_backward: Optional[weakref.WeakMethod] = None  # told at the end of every backward

        # since the last step or zero_grad()
        self.backward_passes = 0  # rounds closed (backward passes that reached us): the step's checks compare it
        self.grad_exists = [False] * len(layout.slots)  # by param index: a gradient since the last clear (else no step)
        self._consumed = [False] * len(layout.slots)  # grad_exists when the last step consumed the gradients
        self._grad_versions: dict[int, int] = {}  # stage 1: param index -> its .grad's version when it arrived
        self.under_ddp: Optional[bool] = None  # DDP wraps the model (it averages param.grad); None: not yet known
        self._outside_ddp: list[int] = []  # under DDP: trainable param indices no DDP wrapper averages (refused)
        self._stepped = False  # a step consumed gradients: the wrapping is settled
        self._taken: Optional[tuple] = None  # under DDP: (backward passes, param.grad versions) at the last take
        self.takes = 0  # under DDP: copies of param.grad into the store

        members = [(storage.bucket.index, index, param) for storage in storages
                   for index, param in zip(storage.bucket.param_indices, storage.params)]
        self._bucket_of = {id(param): (bucket, index) for bucket, index, param in members}  # -> (bucket, param index)
        self._params = {index: param for _, index, param in members}  # param index -> the parameter
        # param index -> the strides of its view of the bucket buffer: its memory format, the gradient slot's too
        self._strides = {index: param.stride() for _, index, param in members}
        hook = _forward_to(weakref.ref(self))  # holds the reducer weakly: a deleted optimizer lets go of the model
        handles = [param.register_post_accumulate_grad_hook(hook) for _, _, param in members]
        self.remove_hooks = weakref.finalize(self, remove_hooks, handles)  # (callable: the optimizer rebuilt)

    def call_after_backward(self, method: Callable[[], None]) -> None:
        """Call bound ``method`` (held weakly) at the end of every backward here, once the round closed or deferred."""
        self._after_backward = weakref.WeakMethod(method)

    @reducer_verb(joined=False)  # the compute streams do not wait for the reduction during backward
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket_index, param_index = self._bucket_of[id(param)]
        if not self.under_ddp and not self._stepped and self.state is RoundState.IDLE and not under_compiled_autograd():
            held = validation.held_by_ddp(list(self._params.values()))  # a heap scan: once a round, till the first step
            self.under_ddp = bool(held)
            self._outside_ddp = [index for index, p in self._params.items() if p.requires_grad and id(p) not in held]
        problem = self._refused(param, bucket_index, param_index)
        if problem is not None:
            with self._own_work():  # no reduction of this backward may stay in flight behind the error
                self._finish_in_flight()
            self._reset_round()
            raise RuntimeError(problem)
        if self._interrupted():  # the user's backward failed part-way: keep what its round reduced
            self._close_round()
        if self.stage == 2 and param_index in self._arrived[bucket_index]:
            self._close_round()  # a second gradient this round: an outer end unseen, or a param in two segments
        self._start_round()
        if self.stage == 1:
            self._grad_versions[param_index] = param.grad._version
            return
        self.grad_exists[param_index] = True
        with self._own_work():
            self._write_grad(bucket_index, param_index, param.grad)
            param.grad = None
            for ready in range(self._started, complete_through(self._arrived, self.layout.buckets, self._started)):
                self.start_grad_sync(ready)

    def _refused(self, param: torch.Tensor, bucket_index: int, param_index: int) -> Optional[str]:
        if under_compiled_autograd():
            return ("ShardedOptimizer does not support compiled autograd (torch._dynamo.config.compiled_autograd): "
                    "its gradient hooks reduce-scatter during backward. Compile the model's forward "
                    "(torch.compile(model)) and run backward without compiled autograd")
        if self.under_ddp and self.stage == 2:
            return validation.DDP_STAGE_2_MESSAGE
        if self.under_ddp and self._outside_ddp:
            return validation.outside_ddp_message(self._outside_ddp)
        if param.grad.is_sparse:
            return ("ShardedOptimizer got a sparse gradient; sparse gradients cannot be sharded. Use dense "
                    "embeddings (e.g. nn.Embedding(sparse=False)).")
        if not self.storages[bucket_index].holds(param_index, param):
            return rebound_message([param_index], param, self.storages[bucket_index].param_buffer)
        return self.unplaced

    def _start_round(self) -> None:
        """Queue the end-of-backward callback unless queued. A new stage-2 round first checks in under ``Join``: a rank
        that joined answers an iteration's first collective with the check-in's all-reduce (the step checks in too)."""
        if self.state is RoundState.RUNNING:
            return
        if self.stage == 2 and self.state is RoundState.IDLE:
            self._checking_in = self.uneven.active  # (the round's first collectives, when under Join)
            with self._own_work():
                self.uneven.check_in()
        callback = _EndOfBackward(weakref.ref(self))
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        self._callback = weakref.ref(callback)  # dies with the backward if it fails
        self.state = RoundState.RUNNING

    def _end_of_backward(self) -> None:
        self._callback = None
        current_node = getattr(torch._C, "_current_autograd_node", None)
        if current_node is not None and current_node() is not None:  # inside another backward's node (reentrant)
            self.state = RoundState.DEFERRED
        else:
            with self.streams.span():
                self._close_round()
        if self._after_backward is not None and (listener := self._after_backward()) is not None:
            listener()

    def _interrupted(self) -> bool:
        """The round's backward failed part-way: the engine dropped its callback."""
        return self.state is RoundState.RUNNING and self._callback() is None

    def _left_open(self) -> bool:
        """A round that no callback will close: deferred by a nested backward, or interrupted."""
        return self.state is RoundState.DEFERRED or self._interrupted()

    def _close_round(self) -> None:
        with self._own_work():
            if self.stage == 2:
                for bucket_index in range(self._started, len(self._buffers)):
                    self.start_grad_sync(bucket_index)
            self._finish_in_flight()
        self._reset_round()
        self.backward_passes += 1

    def _reset_round(self) -> None:
        """The round closed (nothing in flight): the next gradient starts another."""
        self.state, self._callback, self._checking_in = RoundState.IDLE, None, False
        self._reset_buckets()

    def _reset_buckets(self) -> None:
        self._started = 0
        self._arrived = [set() for _ in self._arrived]
        self._buffers = [None] * len(self._buffers)

    @contextmanager
    def _own_work(self) -> Iterator[None]:
        """Run zeroimpl's own work (in a work-stream span): whatever it raises leaves the reducer ``FAILED``."""
        assert self.streams.depth, "the reducer's own work runs inside a span of its work stream (reducer_verb)"
        self._owning += 1
        try:
            yield
        except UnevenInputsError:
            raise  # every rank raises it at the same collective: they stay in step
        except BaseException as error:
            if self.state is RoundState.FAILED:
                raise  # (recorded by an inner block)
            nothing_issued = not (self._checking_in or self._started or self._reducing or self._replicating)
            if not isinstance(error, Exception) and nothing_issued:
                raise  # the user's interrupt (Ctrl-C) before this round issued anything: every rank is still in step
            self.state, self._failure = RoundState.FAILED, f"{type(error).__name__}: {error}"
            if isinstance(error, CollectiveError) or not isinstance(error, Exception):
                raise  # CollectiveError names the way on; an interrupt stays one
            raise RuntimeError(
                f"ShardedOptimizer's gradient reduction failed on this rank ({self._failure}). This rank's "
                "collectives are no longer those of the other ranks, which will raise CollectiveError at their next "
                "collective (within collective_timeout); the optimizer cannot go on. Restart the job from the last "
                "checkpoint (zeroimpl.checkpoint.load_checkpoint)") from error
        finally:
            self._owning -= 1

    def _issue(self, queue: deque, bucket_index: int, buffer: Optional[torch.Tensor], output: torch.Tensor,
               launch: Callable[[], Pending]) -> None:
        """Issue ``launch()`` (the reducer's one way to issue), kept in ``queue`` as an :class:`InFlight` until done."""
        assert self._owning, "the reducer's collectives are issued inside _own_work"
        self.streams.use(*(t for t in (buffer, output) if t is not None))
        queue.append(InFlight(bucket_index, buffer, output, launch()))

    def _buffer(self, bucket_index: int) -> torch.Tensor:
        """This round's buffer of the bucket, born with zero padding (a gradient shard's norm must not see garbage)."""
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
        self._arrived[bucket_index].add(param_index)

    def start_grad_sync(self, bucket_index: int) -> None:
        """Start the next bucket's reduce-scatter (zeros where no gradient came); keep ``max_inflight`` in flight."""
        assert bucket_index == self._started, (bucket_index, self._started)
        bucket = self.layout.buckets[bucket_index]
        buffer = self._buffer(bucket_index)
        for param_index in bucket.param_indices:
            if param_index not in self._arrived[bucket_index]:
                slot = self.layout.slots[param_index]
                buffer[slot.offset:slot.end].zero_()
        output = buffer if self._in_place else buffer.new_empty(bucket.shard_numel)
        if self._blocks is None:
            launch = functools.partial(comm.reduce_scatter, output, buffer, self.group, self.timeout, tag=bucket_index)
        else:
            launch = functools.partial(comm.reduce_scatter_quantized, output, buffer, self._blocks[bucket_index],
                                       self.group, self.timeout, tag=bucket_index)
        self._issue(self._reducing, bucket_index, buffer, output, launch)
        self._buffers[bucket_index] = None
        self._started += 1
        while len(self._reducing) > self.max_inflight:  # bound the buffers: wait for the oldest on the host
            self._finish_oldest(self._reducing, on_host=buffer.is_cuda)

    def _finish_oldest(self, queue: deque, on_host: bool = False) -> None:
        """Finish the oldest collective of ``queue``; hand its shard to the store or, a reduce-scatter's under hybrid
        sharding, to an all-reduce across the replicas (``_replicating``, bounded as ``_reducing`` is)."""
        reduction, work = queue[0], queue[0].work
        # on_host: block the host, not the compute stream (CUDA). Its tensors go on the work stream first: the wait
        # lets go of the work's buffers and queues the 8-bit sum that reads them
        self.streams.use(*(t for t in (reduction.buffer, reduction.output) if t is not None), *work.buffers)
        (work.wait_on_host if on_host else work.wait)()
        queue.popleft()
        if queue is self._replicating or self.replicate is None:
            self.gradients.add(reduction.bucket_index, reduction.output)
            return
        if self._replica_blocks is None:
            launch = functools.partial(comm.all_reduce, reduction.output, torch.distributed.ReduceOp.SUM,
                                       self.replicate, self.timeout, "gradient shard all-reduce across replicas")
        else:
            launch = functools.partial(comm.all_reduce_quantized, reduction.output,
                                       self._replica_blocks[reduction.bucket_index], self.replicate, self.timeout,
                                       tag=reduction.bucket_index)
        self._issue(self._replicating, reduction.bucket_index, None, reduction.output, launch)
        while len(self._replicating) > self.max_inflight:
            self._finish_oldest(self._replicating, on_host=reduction.output.is_cuda)

    def _finish_in_flight(self) -> None:
        for queue in (self._reducing, self._replicating):  # (finishing a reduce-scatter may start an all-reduce)
            while queue:
                self._finish_oldest(queue, on_host=queue is self._replicating and queue[0].output.is_cuda)

    @reducer_verb()
    def finish_grad_sync(self) -> None:
        """Close a round left open by a reentrant or a failed backward; call before any other collective (the other
        ranks issued its reduce-scatters at the end of their backward). Raises if the reducer has failed."""
        if self._left_open():
            self._close_round()

    @reducer_verb()
    def reduce_held_grads(self) -> bool:
        """Stage 1: reduce-scatter what ``param.grad`` holds into the store; return whether there was any (False
        under DDP). Stage 2: refuse a ``param.grad`` set outside the hooks. After :meth:`finish_grad_sync`."""
        if self.under_ddp:
            self._take_averaged_grads()
            self.streams.hand_over(*self.gradients.device_tensors())
            return False
        with_grad = [p for s in self.storages for p in s.params if p.grad is not None]
        if self.stage == 2 and with_grad:
            raise RuntimeError("stage 2 reduces gradients during backward, so a param.grad set outside zeroimpl's "
                               "backward hooks would be ignored. If the model is wrapped in DistributedDataParallel, "
                               "unwrap it (DDP writes all-reduced gradients back; ShardedOptimizer reduces them "
                               "itself); if you set param.grad by hand or with torch.autograd.grad, use stage=1")
        if self.stage == 1 and with_grad:
            self._check_grads_unedited()
            with self._own_work():
                for storage in self.storages:
                    for param_index, param in zip(storage.bucket.param_indices, storage.params):
                        if param.grad is not None:
                            self._write_grad(storage.bucket.index, param_index, param.grad)
                            self.grad_exists[param_index] = True
                            param.grad = None  # freed as copied: the bucket buffers replace the gradients
                    self.start_grad_sync(storage.bucket.index)  # complete or not
                self._finish_in_flight()
            self._reset_buckets()
        self.streams.hand_over(*self.gradients.device_tensors())  # the step reads them next
        return bool(with_grad)

    def _take_averaged_grads(self) -> None:
        """Under DDP (stage 1): copy this rank's pieces of the averaged ``param.grad`` into the store, again whenever
        a backward ran or a ``param.grad`` changed since (clipping, unscaling). ``param.grad`` stays DDP's."""
        taken = (self.backward_passes, tuple(None if p.grad is None else p.grad._version
                                             for p in self._params.values()))
        if taken == self._taken:
            return
        with_grad = {i for i, p in self._params.items() if p.grad is not None}
        self.gradients.clear(set_to_none=True)  # param.grad holds every micro-batch's sum
        self._taken, self.takes = taken, self.takes + 1
        self.grad_exists = [index in with_grad for index in range(len(self.grad_exists))]  # (one set to None since)
        if not with_grad:
            return
        shards = [torch.zeros(bucket.shard_numel, dtype=dtype, device=storage.param_buffer.device)
                  for bucket, dtype, storage in zip(self.layout.buckets, self.reduce_dtypes, self.storages)]
        destinations, sources = [], []  # read in place: one multi-tensor copy (a flattened copy: copied at once)
        for piece in self._pieces:
            if piece.param_index not in with_grad:
                continue
            grad = self._params[piece.param_index].grad
            flat = flattened(grad, self._strides[piece.param_index])
            destination = shards[piece.bucket_index][piece.shard_offset:piece.shard_offset + piece.length]
            if flat.data_ptr() == grad.data_ptr():
                destinations.append(destination)
                sources.append(flat[piece.param_start:piece.param_end])
            else:
                destination.copy_(flat[piece.param_start:piece.param_end])
        if destinations:
            torch._foreach_copy_(destinations, sources)
        for bucket_index, shard in enumerate(shards):
            self.gradients.add(bucket_index, shard)

    def _check_grads_unedited(self) -> None:
        """Refuse an in-place edit since backward of a local gradient (kept by a hook; ``.grad`` itself is a view
        of the average): stage 1 reduces at the step, so the edit would act on this rank's gradient alone."""
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

    @reducer_verb()  # perhaps in a hook of the next backward, on a stream of the forward's
    def forget(self, param_indices: list[int]) -> None:
        """The user cleared these parameters' ``.grad``: zero their shard pieces and forget them, as torch would."""
        cleared = set(param_indices)
        shards = self.gradients.ready()
        self.streams.use(*(shard for shard in shards if shard is not None))
        for piece in self._pieces:
            if piece.param_index in cleared and shards[piece.bucket_index] is not None:
                shards[piece.bucket_index][piece.shard_offset:piece.shard_offset + piece.length].zero_()
        for index in param_indices:
            self.grad_exists[index] = False
            self._consumed[index] = False

    def end_step(self, stepped: Optional[list[bool]] = None) -> None:
        """The step consumed the gradients: clear the store (the reducer is its one owner) and the counts, keeping
        the stepped parameters (``stepped``, agreed across ranks; None: all) for ``zero_grad(set_to_none=False)``."""
        self.backward_passes = 0
        self._consumed = list(stepped) if stepped is not None else [True] * len(self.grad_exists)
        self.grad_exists = [False] * len(self.grad_exists)
        self._grad_versions.clear()
        self._taken, self._stepped = None, True
        self.gradients.clear(set_to_none=True)

    def live_buffers(self) -> list[torch.Tensor]:
        """Bucket buffers and reduction outputs alive right now (for memory accounting)."""
        in_flight = [t for r in (*self._reducing, *self._replicating) for t in (r.buffer, r.output, *r.work.buffers)]
        return [t for t in (*self._buffers, *in_flight) if t is not None]

    @reducer_verb()
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
        if self._left_open():
            self._close_round()  # (its reductions go to the store, cleared below)
        self.backward_passes = 0
        self._grad_versions.clear()
        self._taken = None
        self.grad_exists = ([False] * len(self.grad_exists) if set_to_none
                            else [now or then for now, then in zip(self.grad_exists, self._consumed)])
        self._consumed = [False] * len(self._consumed)
        self.gradients.clear(set_to_none)


def complete_through(arrived: list[set[int]], buckets, start: int) -> int:
    """The end of the run of complete buckets (every parameter arrived) from ``start``: they may start their sync."""
    end = start
    while end < len(buckets) and len(arrived[end]) == len(buckets[end].param_indices):
        end += 1
    return end


def under_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing this backward (its graph cannot hold collectives and callbacks, nor can
    its tracing follow the heap scan that looks for DDP)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return torch.compiler.is_compiling() or bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


class _EndOfBackward:
    """The callback queued on a backward, holding the reducer weakly; the engine drops it if the backward fails."""

    def __init__(self, reducer_ref):
        self.reducer_ref = reducer_ref

    def __call__(self) -> None:
        reducer = self.reducer_ref()  # (a callback of a round closed early, by a second gradient, does nothing)
        if reducer is not None and reducer.state is RoundState.RUNNING and reducer._callback() is self:
            reducer._end_of_backward()


def _forward_to(reducer_ref):
    def hook(param):
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(param)
    return hook


def remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()
