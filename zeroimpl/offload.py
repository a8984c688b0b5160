"""CPU offload (ZeRO-Offload, arXiv 2101.06840): this rank's optimizer shard lives and steps on the host.

Tensors, per bucket (1-D, ``bucket.shard_numel`` elements):

* ``master`` (:class:`~zeroimpl.buffers.BucketStorage`) -- fp32 (fp64 for fp64 models) on the host, pinned when the parameters
  are on CUDA. The inner optimizer updates it, and keeps its state beside it, on the CPU.
* ``host gradient shard`` -- in the master's dtype on the host, pinned likewise: the averaged gradient the host step reads.
* ``device accumulator`` -- reduce dtype, on the device; exists only while the reductions of non-final
  micro-batches (``ShardedOptimizer.accumulating()``) are summed there instead of on the host.

The device keeps only the model's parameters and transient gradient buckets. Stage 2, one micro-batch, CUDA::

    compute : --grad b0--|--grad b1--|--grad b2--|
    nccl    :            |--RS b0----|--RS b1----|--RS b2--|                 |--AG--|
    copy    :                        |D2H b0|    |D2H b1|  |D2H b2|     |H2D|
    host    :                                                   |sync|step|

When the parameters are on the CPU (no GPU) the "device" and the host are the same memory and every copy is
synchronous; the code path is the same, which is what the test suite exercises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from . import comm
from .buffers import HALF_DTYPES, host_master_dtype
from .grad_shards import DeviceGradientShards
from .host_memory import HostArena

# torch optimizers with a fused CPU kernel (torch >= 2.4), about 10x faster than their for-loop kernel
FUSED_CPU_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@dataclass(frozen=True)
class CPUOffload:
    """Offload policy: fp32 master weights, optimizer state and gradient shard on the host; step there."""

    pin_memory: bool = True
    """Page-locked host buffers, so that copies to and from a CUDA device are asynchronous: the host masters,
    gradient shards and staging buffers are slices of one allocation, registered with ``cudaHostRegister``
    as one range of whole pages (torch's ``pin_memory=True`` would round each buffer up to a power of two; it
    is the fallback, with a warning, where the registration fails or torch does not count it). A process
    forked after the optimizer is built does not inherit them (``MADV_DONTFORK``); to hand the host masters
    of a ``state_dict`` to another process, send clones (``torch.multiprocessing`` would move the masters
    themselves into shared memory, out of the page-locked range). Ignored when the parameters are on the
    CPU."""

    fused_step: bool = True
    """Step with the optimizer's fused CPU kernel when it has one (Adam, AdamW, SGD, Adagrad) and the user
    passed neither ``fused`` nor ``foreach``. Results differ from the for-loop kernel in the last bit."""


# what ``offload=`` accepts: no offload, "cpu" (the default policy), or a policy
OffloadOption = Union[None, Literal["cpu"], CPUOffload]


def resolve_offload(offload: "OffloadOption") -> Optional[CPUOffload]:
    """``None`` / ``"cpu"`` / a :class:`CPUOffload` -> the policy, or ``None`` for no offload."""
    if offload is None or isinstance(offload, CPUOffload):
        return offload
    if isinstance(offload, str) and offload == "cpu":
        return CPUOffload()
    raise ValueError(f"offload must be None, 'cpu' or zeroimpl.CPUOffload(...), got {offload!r}")


# param-group keys that choose the inner optimizer's kernel or a mode the fused kernels refuse, not the math:
# a user's choice of any of them keeps the host step off the fused kernel, and each optimizer keeps its own
KERNEL_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def host_optimizer_kwargs(optimizer_class: type, kwargs: dict, group_keys: set, policy: CPUOffload) -> dict:
    """The inner optimizer's keyword arguments for a host step: the fused kernel where it exists, unless the
    user chose a kernel or mode (in ``kwargs`` or, ``group_keys``, in any param group)."""
    if (policy.fused_step and issubclass(optimizer_class, FUSED_CPU_OPTIMIZERS)
            and not KERNEL_KEYS & (set(kwargs) | group_keys)):
        return {**kwargs, "fused": True}
    return kwargs


def refuse_capturable(settings: list[dict]) -> None:
    """Raise where the hyperparameters (keyword arguments, param groups) ask for ``capturable=True``, which keeps
    the step count on the GPU for CUDA graphs: a host step cannot run it (torch refuses at the first step)."""
    if any(setting.get("capturable") for setting in settings):
        raise ValueError("capturable=True keeps the optimizer's step count on the GPU for CUDA graphs, but with "
                         "offload='cpu' the optimizer steps on the host, where torch refuses it: drop capturable=True "
                         "(the host step needs no graph capture), or keep the state on the GPU (offload=None)")


def inner_kwargs(classes: list[type], optimizer_class: type, optimizer_kwargs: dict, groups: list[dict],
                 policy: Optional[CPUOffload]) -> dict[type, dict]:
    """Each inner optimizer class's constructor arguments: ``optimizer_kwargs`` for ``optimizer_class`` (the
    other classes' groups carry their hyperparameters), with the fused host kernel where ``policy`` applies."""
    kwargs = {cls: {} for cls in classes}
    if optimizer_class in kwargs:
        kwargs[optimizer_class] = dict(optimizer_kwargs)  # checked by the class's constructor
    if policy is not None:
        refuse_capturable(groups)  # (they hold optimizer_kwargs too)
        for cls in kwargs:
            group_keys = {key for group in groups if group["optimizer"] is cls for key in group}
            kwargs[cls] = host_optimizer_kwargs(cls, kwargs[cls], group_keys, policy)
    return kwargs


class ShardFill(enum.Enum):
    """What one bucket's host gradient shard holds since the last ``clear()``."""

    EMPTY = "empty"  # no gradient (``ready()`` gives None)
    FILLED = "filled"  # the sum of the reductions since clear(): the next one adds to it
    ZEROED = "zeroed"  # a zero gradient kept by zero_grad(set_to_none=False): the next reduction overwrites it


class HostGradientShards:
    """Gradient shards (fp32) on the host, filled by asynchronous copies as each bucket's reduction completes.

    Invariant: after :meth:`ready` every gradient reduced since :meth:`clear` is summed in the host shards
    (in the order of the reductions, as on the device), and no copy touching host memory is in flight.
    Host syncs: :meth:`ready` waits once per step, whatever the number of buckets.
    """

    def __init__(self, device: torch.device, shards: list[torch.Tensor], timeout: Optional[float] = None):
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copy stream
        self._timeout = timeout  # bounds the wait for the copies (which wait for the reduce-scatters)
        self.shards = shards  # per bucket: zeroed, shard-sized, in the master's dtype (page-locked on CUDA)
        self._fill = [ShardFill.EMPTY] * len(shards)  # per bucket: what the host shard holds
        self._device_sums: list[Optional[torch.Tensor]] = [None] * len(shards)  # device accumulators
        self._copying = False  # a copy was queued since the last wait
        self.accumulating = False  # set by ShardedOptimizer.accumulating(): keep sums on the device

    def add(self, bucket_index: int, reduced: torch.Tensor) -> None:
        """Take one reduction of a bucket (``reduced``: device, reduce dtype), issued in the current stream."""
        device_sum = self._device_sums[bucket_index]
        if device_sum is not None:
            reduced = device_sum.add_(reduced)
            self._device_sums[bucket_index] = None
        if self.accumulating:
            self._device_sums[bucket_index] = reduced
        else:
            self._to_host(bucket_index, reduced)

    def _to_host(self, bucket_index: int, reduced: torch.Tensor) -> None:
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
                host.copy_(reduced, non_blocking=True)  # (a dtype change allocates on the device: may raise)
            reduced.record_stream(self._stream)  # the allocator must not reuse it before the copy has run
            self._copying = True
        self._fill[bucket_index] = ShardFill.FILLED  # (a ZEROED shard is overwritten; once the copy is queued)

    def wait_copies(self) -> None:
        """Block until no gradient copy to the host is in flight (the host shards may then be read or written):
        a wait on the copy stream when a copy was queued since the last one, else nothing."""
        if self._copying:
            comm.wait_for_stream(self._stream, self._timeout, "gradient copies to the host")
            self._copying = False

    def ready(self) -> list[Optional[torch.Tensor]]:
        """Every gradient on the host, every copy finished: the host shards, ``None`` where no gradient came."""
        for index, device_sum in enumerate(self._device_sums):
            if device_sum is not None:  # accumulating() was still on at step: move the sum over now
                self._device_sums[index] = None
                self._to_host(index, device_sum)
        self.wait_copies()
        return [None if fill is ShardFill.EMPTY else shard for shard, fill in zip(self.shards, self._fill)]

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
        return (any(fill is not ShardFill.EMPTY for fill in self._fill)
                or any(s is not None for s in self._device_sums))

    def device_tensors(self) -> list[torch.Tensor]:
        return [s for s in self._device_sums if s is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.shards)



def staging_sizes(layout, param_dtypes: list[torch.dtype]) -> dict[torch.dtype, int]:
    """For each 16-bit parameter dtype of the layout's buckets, the largest shard of that dtype: the size of
    each of :class:`~zeroimpl.param_sync.ParamSync`' two staging buffers for it (``param_dtypes``: by parameter index)."""
    sizes: dict[torch.dtype, int] = {}
    for bucket in layout.buckets:
        dtype = param_dtypes[bucket.param_indices[0]]
        if dtype in HALF_DTYPES:
            sizes[dtype] = max(sizes.get(dtype, 0), bucket.shard_numel)
    return sizes


def host_buffers(layout, param_dtypes: list[torch.dtype], pin_device: Optional[torch.device]
                 ) -> tuple[HostArena, list[torch.Tensor], list[torch.Tensor], dict[torch.dtype, list[torch.Tensor]]]:
    """Offload's host memory, carved out of one :class:`HostArena` (page-locked for ``pin_device``): per
    bucket a master and a gradient shard (shard-sized, :func:`host_master_dtype`), and per 16-bit dtype the
    two staging buffers of :func:`staging_sizes` (``param_dtypes``: by parameter index)."""
    buckets = len(layout.buckets)
    dtypes = [host_master_dtype(param_dtypes[b.param_indices[0]]) for b in layout.buckets]
    staging = staging_sizes(layout, param_dtypes)
    sizes = [(b.shard_numel, d) for b, d in zip(layout.buckets, dtypes)] * 2
    sizes += [(numel, dtype) for dtype, numel in staging.items() for _ in range(2)]
    arena = HostArena(sizes, pin_device)
    slices = arena.slices
    staged = {dtype: slices[2 * buckets + 2 * k:2 * buckets + 2 * k + 2] for k, dtype in enumerate(staging)}
    return arena, slices[:buckets], slices[buckets:2 * buckets], staged


def gradient_store(policy: Optional[CPUOffload], layout, params: list[torch.nn.Parameter],
                   timeout: Optional[float] = None):
    """Where the gradient shards live: ``(host arenas, host masters per bucket or None, the gradient store,
    staging buffers per 16-bit dtype)``; without ``policy`` nothing on the host and a
    :class:`~zeroimpl.grad_shards.DeviceGradientShards`, with it one arena holding masters, gradient shards
    and staging (page-locked when the parameters are on CUDA) and a :class:`HostGradientShards`, whose waits
    for its copies ``timeout`` bounds."""
    device = params[0].device
    if policy is None:
        return [], None, DeviceGradientShards(len(layout.buckets)), {}
    pin = device if policy.pin_memory and device.type == "cuda" else None
    arena, masters, gradients, staging = host_buffers(layout, [p.dtype for p in params], pin)
    return [arena], masters, HostGradientShards(device, gradients, timeout), staging
