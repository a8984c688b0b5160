"""ShardedOptimizer: ZeRO stage 1 and 2 around torch optimizers, elementwise (AdamW) or not (Muon, Adafactor).

One optimizer step, as seen from one rank (Ψ trainable elements, N ranks)::

    backward  -> gradients reduce-scattered into this rank's gradient shard (Ψ/N)   [grad_sync.py]
                 kept on the device, or copied to the host with offload              [grad_shards.py, offload.py]
    step      -> (loss scaling: unscale) -> agree across ranks on NaN/Inf (fused with the clipping norm)
              -> inner optimizer on the shard's master weights (or skip the step: see ``nonfinite``)
              -> master written into this rank's slice of the flat parameter buffers
              -> in-place all-gather of every parameter buffer (Ψ), bucket by bucket  [comm.py]
                 (offload: each bucket's host step, copy and all-gather in turn, a pipeline), left in
                 flight into the next forward (``overlap_param_gather``)            [inflight.py]

The inner optimizer (e.g. torch.optim.AdamW) sees one tensor per *piece*: the part of one parameter that
lies in this rank's master shard (a view of the shard; padding belongs to no piece) -- 1-D in flat groups,
the whole parameter in its own shape in whole-parameter groups (Muon, Adafactor: see ``optimizer_kinds``).
It therefore holds optimizer state for about Ψ/N elements only -- on the host, with CPU offload -- and, as
torch does per parameter, skips a piece whose parameter has no gradient on any rank (state, step count and
weights untouched). Param groups may name their own optimizer class (``{"params": ..., "optimizer":
torch.optim.Muon}``): one inner optimizer per class (``inner.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Collection, Iterable, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from . import comm, optimizer_kinds, optimizer_state, uneven, validation
from .accounting import MemoryReport, StateBytes, tensor_bytes
from .buffers import BucketStorage, flatten_params
from .grad_shards import DeviceGradientShards
from .grad_sync import GradientReducer, check_not_owned, rebound_message
from .grad_views import GradViews
from .host_memory import HostArena, device_tensor, to_device
from .inflight import InFlightGathers
from .inner import InnerOptimizers
from .layout import ShardLayout, ShardPiece, build_layout, trainable_specs
from .memory_format import shaped
from .offload import (KERNEL_KEYS, CPUOffload, HostGradientShards, OffloadOption, host_optimizer_kwargs,
                      host_buffers, resolve_offload)
from .precision import DynamicLossScaler, LossScaleConfig
from .step_state import StepState, StepVerdict, decode_checks, encode_checks
from .topology import Topology, resolve_topology

# param-group keys about the model's parameters, which the inner optimizer (over pieces) does not have, and
# the group's optimizer class (not a hyperparameter: never saved with them)
OUTER_ONLY_KEYS = frozenset({"params", "param_names", "optimizer"})


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """Shards optimizer state (stage 1) and gradients (stage 2) of ``params`` across data-parallel ranks.

    Args:
        params: parameters or param-group dicts, as any torch optimizer takes. Frozen parameters
            (``requires_grad=False``) are left alone. The model must be the same on every rank and must not
            be wrapped in DistributedDataParallel: this optimizer reduces the gradients itself. A group may
            name its own optimizer class under the key ``"optimizer"`` (e.g. ``{"params": matrices,
            "optimizer": torch.optim.Muon, "lr": 0.02}``); its other keys are that class's hyperparameters.
            ``optimizer_kwargs`` apply to the groups of ``optimizer_class`` only.
        optimizer_class: the ``torch.optim.Optimizer`` subclass of the groups that name none. Elementwise
            classes (AdamW, Adam, SGD, ...) get flat shards; Muon, Adafactor and the classes in
            ``per_parameter`` get whole-parameter shards (each parameter stepped whole, by one rank); LBFGS
            and SparseAdam are refused.
        stage: 1 -- shard optimizer state and master weights; gradients are reduce-scattered once per step.
            2 -- also shard gradients: they are reduce-scattered bucket by bucket during backward.
        offload: ``None``, ``"cpu"`` or :class:`zeroimpl.CPUOffload`. With offload the fp32 master weights,
            the optimizer state and the fp32 gradient shard live in host memory and the step runs on the
            CPU (with the optimizer's fused CPU kernel where it has one); the device keeps only the
            parameters and transient gradient buckets. With gradient accumulation in stage 2, run the
            non-final micro-batches under ``optimizer.accumulating()`` so that they sum on the device and
            the shard crosses to the host once per step.
        process_group: the data-parallel group (default: the whole world).
        device_mesh: instead of ``process_group``, a ``torch.distributed.DeviceMesh``. 1-D: as its group. 2-D
            (replicate x shard, dims named ``("replicate", "shard")`` as FSDP2's HSDP, or unnamed): *hybrid
            sharding* -- optimizer state (and, in stage 2, gradients) sharded within each shard group (a row:
            typically one node), replicated across the replicate group (a column). Per step: reduce-scatter
            in the shard group, all-reduce of the shard across replicas, all-gather in the shard group, so
            that the traffic between replicas is Ψ/n per rank (n: shard-group size) instead of DDP's 2Ψ.
            ``rank`` and ``world_size`` then describe the shard group; ``topology`` describes both.
        bucket_numel: elements per gradient/parameter bucket (default 2**22, 16 MiB of fp32). Larger
            buckets mean fewer, larger collectives; smaller ones more overlap and smaller transient buffers.
        max_inflight_buckets: reduce-scatters allowed in flight before backward waits for the oldest
            (default 2). Bounds the bucket buffers alive during backward; 0 waits for each at once.
        reduce_dtype: dtype in which gradients are reduced and the gradient shard is kept. Default: fp32
            (fp64 for fp64 parameters), for accuracy with 16-bit models.
        loss_scale: dynamic loss scaling. ``"auto"`` (default): on with default settings when any parameter
            is fp16, off otherwise. A :class:`LossScaleConfig`: on with those settings, whatever the dtype --
            use it for fp16 autocast over fp32 parameters. ``None``: off. When on, call
            ``optimizer.backward(loss)`` (or ``optimizer.scale_loss(loss).backward()``) instead of
            ``loss.backward()``; steps whose gradients overflow are skipped and the scale backs off.
        verify_every: every this many optimizer steps, compare a checksum of every bucket of parameters
            across ranks after the step (one small all-reduce) and raise :class:`zeroimpl.DivergenceError`
            naming the first parameter that differs (default ``None``: never). Ranks that silently diverge
            (a rank-dependent bug in user code, a corrupted update) then stop within ``verify_every`` steps.
        nonfinite: what ``step()`` does when the averaged gradients hold NaN or Inf and no loss scaling is on
            (or the loss scale is already at its minimum). ``"raise"`` (default): clear the gradients, leave
            parameters and state untouched, and raise ``FloatingPointError`` on every rank. ``"skip"``: clear
            the gradients, skip the step and count it in ``skipped_steps``. Never an update with NaN.
        collective_timeout: seconds any one of this optimizer's collectives on CPU tensors (gloo) may take
            before it raises :class:`zeroimpl.CollectiveError` (a rank died or hangs). Default ``None``: the
            process group's own timeout (``init_process_group(timeout=...)``). On CUDA, NCCL's watchdog
            enforces the process group's timeout (a bounded wait would block the host). A rank that dies
            outright is usually noticed at once (gloo sees the connection drop; torchrun stops the others).
        alignment: each bucket is padded to a multiple of ``world_size * alignment`` elements (default 8).
        overlap_param_gather: leave each bucket's parameter all-gather in flight at the end of ``step()``
            (default ``True``): the first torch operation or module forward that touches one of its
            parameters waits for it (Megatron's overlap_param_gather, with every other read covered too: see
            :mod:`zeroimpl.inflight` for how, and for the reads it cannot see, which need
            :meth:`finish_param_gathers` or ``False``). Results are bitwise those of ``False``, which waits
            for every bucket in ``step()``.
        assume_elementwise: shard optimizer classes zeroimpl does not know flat; only set it if they update
            every element from its own parameter, gradient and state.
        per_parameter: optimizer classes to shard by whole parameters (a Shampoo or SOAP implementation, or
            any class whose update of a parameter needs all of it), besides Muon and Adafactor.
        **optimizer_kwargs: passed to ``optimizer_class`` (lr, weight_decay, betas, ...).

    Invariant: every rank holds the same parameters after ``step()``; rank r's inner optimizers hold state
    for chunk r of every bucket only.
    """

    def __init__(self, params: Union[Iterable[torch.Tensor], Iterable[dict]], optimizer_class: type,
                 stage: Literal[1, 2] = 2, *, offload: OffloadOption = None,
                 process_group: Optional[dist.ProcessGroup] = None, device_mesh=None,
                 bucket_numel: int = 2 ** 22, max_inflight_buckets: int = 2,
                 reduce_dtype: Optional[torch.dtype] = None,
                 loss_scale: Union[Literal["auto"], None, LossScaleConfig] = "auto",
                 nonfinite: Literal["raise", "skip"] = "raise",
                 collective_timeout: Optional[float] = None, alignment: int = 8, assume_elementwise: bool = False,
                 per_parameter: Collection[type] = (), verify_every: Optional[int] = None,
                 overlap_param_gather: bool = True, **optimizer_kwargs):
        validation.check_stage(stage)
        validation.check_loss_scale(loss_scale)
        validation.check_nonfinite(nonfinite)
        validation.check_timeout(collective_timeout)
        self.collective_timeout = collective_timeout
        self.offload: Optional[CPUOffload] = resolve_offload(offload)
        optimizer_kinds.check_class(optimizer_class)
        groups = optimizer_kinds.groups_with_classes(params, optimizer_class, optimizer_kwargs)
        classes = [group["optimizer"] for group in groups]
        optimizer_kinds.check_per_parameter(per_parameter)
        sharding = {cls: optimizer_kinds.sharding_of(cls, per_parameter, assume_elementwise) for cls in classes}
        validation.check_process_group(process_group)
        self.topology: Topology = resolve_topology(process_group, device_mesh)
        if max_inflight_buckets < 0:
            raise ValueError(f"max_inflight_buckets must be >= 0, got {max_inflight_buckets}")
        validation.check_verify_every(verify_every)
        self.verify_every = verify_every
        self.overlap_param_gather = bool(overlap_param_gather)
        self._gathers = InFlightGathers()  # parameter all-gathers left in flight by step()
        self._steps_taken = 0  # updates applied (skipped steps do not count)
        self._constructed = False
        super().__init__(groups, {})  # refuses duplicates
        Joinable.__init__(self)  # under torch's Join: uneven inputs raise on every rank (zeroimpl/uneven.py)

        self.stage = stage
        self.process_group = self.topology.shard  # reduce-scatter and all-gather run here
        self.rank = self.topology.shard_rank
        self.world_size = self.topology.shard_size

        trainable, specs = trainable_specs(self.param_groups, [optimizer_kinds.step_work(cls)
                                                               if sharding[cls] == "whole" else None
                                                               for cls in classes])
        layout = build_layout(specs, self.world_size, bucket_numel, alignment)
        # the layout depends on each group's class and kind too: ranks must agree on it, not only on the params
        validation.check_params(trainable, self.topology, collective_timeout, layout.fingerprint())
        _check_whole_groups(self.param_groups)
        check_not_owned(trainable)  # before the parameters are moved into this optimizer's buffers

        self.trainable_params: list[torch.nn.Parameter] = trainable  # indexed by layout parameter index
        # frozen when built: a later requires_grad=True cannot join the fixed layout (checked at every step)
        self._frozen_params = [p for group in self.param_groups for p in group["params"] if not p.requires_grad]
        self.layout: ShardLayout = layout
        self._pieces: list[ShardPiece] = self.layout.pieces(self.rank)  # this rank's part of each parameter
        self._device = trainable[0].device
        host_masters = None
        self.host_arenas: list[HostArena] = []  # offload: one allocation, page-locked on CUDA
        if self.offload is not None:  # masters, gradient shards and staging on the host, in one arena
            pin = self._device if self.offload.pin_memory and self._device.type == "cuda" else None
            arena, host_masters, host_gradients, host_staging = host_buffers(layout, [p.dtype for p in trainable],
                                                                             pin)
            self.host_arenas = [arena]
        self.storages: list[BucketStorage] = flatten_params(self.layout, trainable, self.rank, host_masters)
        kwargs = {cls: {} for cls in classes}  # a class's groups carry its hyperparameters
        if optimizer_class in kwargs:
            kwargs[optimizer_class] = dict(optimizer_kwargs)  # checked by the class's constructor
        if self.offload is not None:
            for cls in kwargs:
                group_keys = {key for group in self.param_groups if group["optimizer"] is cls for key in group}
                kwargs[cls] = host_optimizer_kwargs(cls, kwargs[cls], group_keys, self.offload)
            self.gradients = HostGradientShards(self.storages, host_gradients, host_staging)
        else:
            self.gradients = DeviceGradientShards(len(self.storages))
        self.inner = InnerOptimizers(self._inner_groups(), classes, kwargs)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in inner.items():
                outer.setdefault(key, value)
        self.defaults = self.inner.defaults

        if loss_scale == "auto":
            loss_scale = LossScaleConfig() if any(p.dtype == torch.float16 for p in trainable) else None
        self.loss_scaler: Optional[DynamicLossScaler] = DynamicLossScaler(loss_scale) if loss_scale else None
        self.nonfinite = nonfinite
        self._skipped_without_scaler = 0
        self._wrapping_checked = False
        self._step_state = StepState()  # this step's progress: loss scaled, shards unscaled, checks' verdict

        reduce_dtypes = [reduce_dtype or torch.promote_types(s.param_buffer.dtype, torch.float32)
                         for s in self.storages]
        weakref.finalize(self, self._gathers.finish)  # no gather outlives its optimizer unfinished, no guard stays
        # param.grad after backward: views of the averaged gradient in the shards, for torch's own utilities
        self.grad_views = GradViews(trainable, self._pieces, stage, _weakly(self._prepare_for_views),
                                    _weakly(self._grad_shards_by_bucket), _weakly(self._forget_gradients),
                                    self.topology.shard, collective_timeout)
        self.reducer = GradientReducer(self.layout, self.storages, self.topology, stage, reduce_dtypes,
                                       max_inflight_buckets, self.gradients,
                                       weakref.WeakMethod(self._check_gradient_arrival), self.grad_views,
                                       collective_timeout)
        self._constructed = True

    def _inner_groups(self) -> list[dict]:
        """The inner optimizer's param groups: one view of the master shard per piece, in piece order (in the
        parameter's shape in whole-parameter buckets, 1-D otherwise)."""
        self._piece_masters = [self._piece_view(self.storages[p.bucket_index].master, p) for p in self._pieces]
        groups = [{**{k: v for k, v in g.items() if k not in OUTER_ONLY_KEYS}, "params": []} for g in self.param_groups]
        for piece, master in zip(self._pieces, self._piece_masters):
            groups[self.layout.buckets[piece.bucket_index].group_index]["params"].append(master)
        return groups

    def _piece_view(self, shard: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
        """The elements of ``piece`` in a shard-sized tensor: 1-D, or shaped as the parameter when whole."""
        flat = shard[piece.shard_offset:piece.shard_offset + piece.length]
        if self.layout.buckets[piece.bucket_index].whole:
            param = self.trainable_params[piece.param_index]
            return shaped(flat, param.shape, param.stride())
        return flat

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", True):
            raise NotImplementedError("ShardedOptimizer cannot add param groups after construction (the shard "
                                      "layout is fixed); pass every group to the constructor")
        super().add_param_group(param_group)

    # -- backward ---------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> Optional[float]:
        """Current loss scale, or None when no loss scaling is used."""
        return self.loss_scaler.scale if self.loss_scaler else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the averaged gradients held NaN or Inf (those that raised too).
        Saved with the loss scaler's state when loss scaling is on; otherwise counted from construction."""
        return self.loss_scaler.skipped_steps if self.loss_scaler else self._skipped_without_scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current loss scale (fp32), for a backward the caller runs; the loss
        itself when no loss scaling is on."""
        if self.loss_scaler is None:
            return loss
        self._step_state.loss_scaled = True
        return loss.float() * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()``, with the loss multiplied by the loss scale when loss scaling is on."""
        self.scale_loss(loss).backward(**backward_kwargs)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-batches of gradient accumulation.

        Only offload in stage 2 uses the hint: those micro-batches' reductions are summed on the device,
        and the sum crosses to the host with the final micro-batch's, once per step. Without the hint every
        micro-batch is copied to the host as it completes and summed there (correct, but more traffic and
        a host sync per bucket). Forgetting to leave it is harmless: ``step()`` moves any device sum over.
        """
        previous = self.gradients.accumulating
        self.gradients.accumulating = True
        try:
            yield
        finally:
            self.gradients.accumulating = previous

    def _check_gradient_arrival(self) -> None:
        self._step_state.gradient_arrived(loss_scaling=self.loss_scaler is not None)
        if self.stage == 2 and self.reducer.round_idle:  # this backward's reduce-scatters are about to start
            uneven.check_in(self)

    # -- torch.distributed.algorithms.Join ---------------------------------------------------------
    def join_hook(self, **kwargs) -> uneven.RefuseUnevenInputs:
        """Under ``Join``, a rank that ran out of data makes every rank raise ``UnevenInputsError``."""
        return uneven.RefuseUnevenInputs(self.join_device, self.join_process_group)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group if self.topology.replicate is None else dist.group.WORLD

    # -- gradients --------------------------------------------------------------------------------
    def _prepare_gradients(self) -> bool:
        """Finish the reduction (and unscaling); return whether there are gradients to step on. Then every
        trainable parameter's ``.grad`` is its view of the averaged gradient (:mod:`zeroimpl.grad_views`)."""
        self.finish_param_gathers()
        uneven.check_in(self)
        if not self._wrapping_checked:  # the first time only: a DDP wrapper exists by the first step
            validation.check_not_wrapped_in_ddp(self.trainable_params[0])
            self._wrapping_checked = True
        self._check_model_unchanged()
        self.grad_views.withdraw()  # .grad as the reducer left it (stage 1: the local gradients)
        self.reducer.finalize()
        if not self.gradients.has_gradients and not any(self.reducer.grad_exists):
            return False  # (zero gradients kept by zero_grad(set_to_none=False) step, as in torch)
        if self.loss_scaler is not None and not self._step_state.unscaled:
            torch._foreach_mul_(self._grad_shards(), 1.0 / self.loss_scaler.scale)
            self._step_state.unscaled = True
        self.grad_views.expose(prepared=True)
        return True

    def _prepare_for_views(self) -> None:
        """The first operation on a gradient view after a backward: reduce and unscale (collective)."""
        with torch.no_grad():
            self._prepare_gradients()

    def _grad_shards_by_bucket(self) -> list[Optional[torch.Tensor]]:
        return self.gradients.ready()

    def _forget_gradients(self, param_indices: list[int]) -> None:
        """The user cleared these parameters' ``.grad`` (``model.zero_grad()``, ``p.grad = None``): zero their
        elements of the gradient shards and forget that they had a gradient, as torch would."""
        shards = self.gradients.ready()
        for piece in self._pieces:
            shard = shards[piece.bucket_index]
            if piece.param_index in param_indices and shard is not None:
                shard[piece.shard_offset:piece.shard_offset + piece.length].zero_()
        self.reducer.forget(param_indices)

    def _check_model_unchanged(self) -> None:
        """Raise, before any collective of the step, if the model no longer is what the layout describes."""
        unfrozen = [i for i, p in enumerate(self._frozen_params) if p.requires_grad]
        if unfrozen:
            raise RuntimeError(
                f"{len(unfrozen)} parameter(s) of the param groups were frozen (requires_grad=False) when the "
                "ShardedOptimizer was built and now require grad; the shard layout is fixed, so they would never "
                "be trained. Build the optimizer with every parameter you will train unfrozen and freeze what "
                "you need afterwards (a parameter without a gradient is not updated, as in torch), or delete this "
                "optimizer and build a new ShardedOptimizer after unfreezing (a checkpoint carries the state over)")
        if self.reducer.replaced:
            raise RuntimeError(
                f"the model replaced parameters that this optimizer manages ({', '.join(self.reducer.replaced[:5])}) "
                "with other Parameter objects (load_state_dict(assign=True), module.weight = nn.Parameter(...)), "
                "so the optimizer would keep updating the old ones. Load with assign=False (the default), or "
                "build the ShardedOptimizer after changing the model")
        rebound = [i for s in self.storages for i in s.rebound_params()]
        if rebound:
            raise RuntimeError(rebound_message(rebound))

    def _agree_on_gradients(self, norm_type: Optional[float] = None) -> Optional[torch.Tensor]:
        """One all-reduce of 5 elements (:func:`encode_checks`): whether any rank's gradient shard holds NaN/Inf
        (stored in ``StepVerdict.nonfinite``), whether every rank ran the same number of backward passes, and, given
        ``norm_type``, the global gradient norm (returned, on the device), and whether some rank lacks a
        gradient for some parameter: only then does a second all-reduce (one flag per parameter) tell which
        parameters have a gradient on no rank (``StepVerdict.stepped``), so that they are not stepped.

        NaN/Inf is read off the shard norms this rank computes anyway (2-norm when not clipping): one pass
        over the gradients, no mask. A norm that is not finite flags the step; only then, on every rank
        alike, :meth:`_any_nonfinite` tells NaN/Inf apart from finite gradients whose norm overflows fp32.
        Every rank decodes the same verdict (:func:`decode_checks`). The one host sync of the step (two on a
        step whose norm is not finite). Norms are taken in fp32, or fp64 for fp64 shards. Call after
        ``_prepare_gradients``.
        """
        shards = self._grad_shards()
        device = shards[0].device if shards else self._device
        passes = float(self.reducer.backward_passes)
        maximum = norm_type == float("inf")
        if maximum:
            norm_term = torch.stack([torch.linalg.vector_norm(s, norm_type, dtype=_norm_dtype(s))
                                     for s in shards] or [torch.zeros((), device=device)]).max()
        else:
            power = 2.0 if norm_type is None else norm_type
            norm_term = torch.stack([torch.linalg.vector_norm(s, power, dtype=_norm_dtype(s)) ** power
                                     for s in shards] or [torch.zeros((), device=device)]).sum()
            if self.topology.replicate_rank != 0:  # the replicas hold the same shards: count them once
                norm_term = torch.zeros_like(norm_term)
        values = to_device(encode_checks(norm_term, passes, not all(self.reducer.grad_exists), maximum), self._device)
        agreed = self.topology.all_reduce_(values, dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM,
                                           self.collective_timeout, "gradient check all-reduce")
        suspect, same_passes, lacking = decode_checks(agreed.tolist(), maximum,  # the host sync
                                                      self.topology.world_size)
        if not same_passes:
            self.zero_grad()
            raise RuntimeError(
                f"the ranks ran different numbers of backward passes before step() (this rank: {int(passes)}); "
                "every rank must run the same micro-batches per optimizer step. The gradients were cleared; "
                "nothing was updated")
        verdict = StepVerdict(nonfinite=suspect and self._any_nonfinite(shards),
                              stepped=self._params_with_gradients() if lacking else None)
        self._step_state.verdict = verdict
        if norm_type is None:
            return None
        if verdict.nonfinite and maximum:  # a MAX all-reduce need not carry a NaN through
            return torch.full((), float("nan"), device=self._device)
        return agreed[1] if maximum else agreed[1] ** (1.0 / norm_type)

    def _params_with_gradients(self) -> list[bool]:
        """By parameter index, whether any rank has a gradient for it (one all-reduce of a flag per parameter,
        run on every rank alike, only on steps where some rank lacks some gradient)."""
        local = device_tensor(self.reducer.grad_exists, self._device, torch.float32)
        agreed = self.topology.all_reduce_(local, dist.ReduceOp.MAX, self.collective_timeout,
                                           "gradient presence all-reduce")
        return [flag > 0 for flag in agreed.tolist()]

    def _any_nonfinite(self, shards: list[torch.Tensor]) -> bool:
        """Whether any rank's gradient shard holds NaN/Inf, exactly (a mask per shard, one more all-reduce
        and host sync). Runs only on steps whose norm is not finite, on every rank together."""
        local = torch.stack([~torch.isfinite(s).all() for s in shards]).any().float().reshape(1)
        local = to_device(local, self._device)
        agreed = self.topology.all_reduce_(local, dist.ReduceOp.MAX, self.collective_timeout,
                                           "gradient NaN/Inf all-reduce")
        return bool(agreed.item())

    def found_nonfinite(self) -> bool:
        """Whether this step's averaged (unscaled) gradients hold NaN or Inf on any rank, so that ``step()``
        will skip the update (or raise, see ``nonfinite``). Identical on every rank; collective.

        Finishes the reduction and runs the step's small all-reduce, whose answer ``step()`` then reuses
        (until a new gradient arrives).
        """
        if not self._prepare_gradients():
            return False
        if self._step_state.verdict is None:
            self._agree_on_gradients()
        return self._step_state.verdict.nonfinite

    def _grad_shards(self) -> list[torch.Tensor]:
        """The gradient shards of the buckets that have one (on the host with offload)."""
        return [shard for shard in self.gradients.ready() if shard is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients of the whole model to ``max_norm``; return their total norm.

        Equal to ``torch.nn.utils.clip_grad_norm_`` over the full averaged gradients, computed from the
        shards with one all-reduce of five elements (the norm, and the checks that ``step()`` then
        reuses). The result is identical on every rank. Gradients with NaN or Inf are left unclipped: the
        returned norm is then NaN or Inf, and ``step()`` will skip or raise.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        if not self._prepare_gradients():
            return torch.zeros((), device=self._device)
        total = self._agree_on_gradients(norm_type)
        shards = self._grad_shards()
        if not self._step_state.verdict.nonfinite and shards:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            # offload on a GPU: this copy of one scalar to the host is the step's second sync (with clipping)
            torch._foreach_mul_(shards, coefficient.to(shards[0].device))
            self.grad_views.changed()
        return total

    # -- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._prepare_gradients():
            return loss
        if not self.found_nonfinite():
            self._update()
            return loss
        raises = self.nonfinite == "raise" and (
            self.loss_scaler is None or self.loss_scaler.scale <= self.loss_scaler.config.min_scale)
        self._skip_step()
        if raises:
            at_minimum = f" even at the minimum loss scale {self.loss_scale}" if self.loss_scaler else ""
            raise FloatingPointError(
                f"the averaged gradients hold NaN or Inf{at_minimum}: this step was not applied and its gradients "
                "were cleared (parameters and optimizer state are unchanged, on every rank). Usual causes: a "
                "learning rate too high, a diverging loss, bad input data, or fp16 without loss scaling. Fix the "
                "cause (lower the learning rate, clip gradients, use bf16), or pass nonfinite='skip' to skip such "
                "steps and count them in optimizer.skipped_steps")
        return loss

    def _skip_step(self) -> None:
        """Discard this step's gradients and count the skip (the loss scaler backs off)."""
        self.reducer.zero_grad(set_to_none=True)
        if self.loss_scaler is None:
            self._skipped_without_scaler += 1
        self._finish_step(overflow=True)

    def _update(self) -> None:
        """Step the inner optimizer on the master shards and all-gather the new parameters."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k not in OUTER_ONLY_KEYS | KERNEL_KEYS})
        stepped = self._step_state.verdict.stepped
        grads = []  # per bucket: the gradient shard in the master's dtype, or None
        for storage, grad in zip(self.storages, self.gradients.ready()):
            storage.sync_master_with_params()
            grads.append(None if grad is None else grad.to(storage.master.dtype))
        piece_grads = {}  # bucket index -> [(master, its gradient)], pieces that step
        for piece, master in zip(self._pieces, self._piece_masters):
            grad = grads[piece.bucket_index]
            if stepped is not None and not stepped[piece.param_index]:
                continue  # no gradient on any rank: torch would not touch it either
            if grad is None:  # a zero gradient kept by zero_grad(set_to_none=False), nothing reduced since
                grad = torch.zeros_like(master)
            else:
                grad = self._piece_view(grad, piece)
            piece_grads.setdefault(piece.bucket_index, []).append((master, grad))
        if self.offload is None:  # one step over every piece (one launch of each kernel), then the copies
            self._step_inner([g for pairs in piece_grads.values() for g in pairs])
            self._publish_and_gather(defer=self.overlap_param_gather)
        else:  # the host step bucket by bucket, each bucket copied and all-gathered while the next one steps
            self._publish_and_gather(defer=self.overlap_param_gather,
                                     prepare=lambda storage: self._step_inner(piece_grads.get(storage.bucket.index,
                                                                                              [])))
        self._steps_taken += 1
        self._finish_step(overflow=False)
        if self.verify_every and self._steps_taken % self.verify_every == 0:
            self.verify_ranks_agree()

    def _step_inner(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Step the inner optimizers on these (master view, gradient) pairs alone: torch's optimizers skip
        parameters without a gradient, and every class zeroimpl shards updates each parameter (flat: each
        element) from its own gradient and state, so stepping the pieces in parts is bitwise stepping them
        at once."""
        if not pieces:
            return
        for master, grad in pieces:
            master.grad = grad
        self.inner.step()
        for master, _ in pieces:
            master.grad = None

    def _publish_and_gather(self, defer: bool = False,
                            prepare: Optional[Callable[[BucketStorage], None]] = None) -> None:
        """Write each bucket's updated master weights into its shard of the parameters and all-gather the
        bucket, bucket by bucket: a bucket's all-gather is queued right after its copy, so that it overlaps
        the next bucket's copy (with offload, the host-to-device copies). ``prepare(storage)`` runs first for
        each bucket (with offload: its host step, which then overlaps the previous bucket's copy and
        all-gather). ``defer``: leave the gathers in flight (``overlap_param_gather``) for the guards of
        :mod:`zeroimpl.inflight` to wait for."""
        self.finish_param_gathers()
        pending = {}

        def gather(storage: BucketStorage) -> None:
            pending[storage.bucket.index] = comm.all_gather(storage.param_buffer, storage.shard, self.process_group,
                                                            self.collective_timeout, tag=storage.bucket.index)
        self.gradients.publish(self.storages, gather, prepare)
        # the all-gather writes the parameters in place: let autograd refuse graphs built before it
        torch.autograd.graph.increment_version([p for s in self.storages for p in s.params])
        for storage in self.storages:
            storage.mark_master_in_sync()
        self._gathers.start(pending, {s.bucket.index: s.param_buffer for s in self.storages},
                            {s.bucket.index: s.params for s in self.storages}, guard=defer)

    def finish_param_gathers(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the parameter all-gathers still in flight (``overlap_param_gather``): of ``buckets``, or of
        every bucket. After it, the model's parameters hold this step's values. Local: it waits only for
        collectives every rank issued in ``step()``."""
        self._gathers.finish(buckets)

    @property
    def param_gathers_in_flight(self) -> int:
        """How many buckets' parameter all-gathers are still in flight (``overlap_param_gather``)."""
        return len(self._gathers)

    @torch.no_grad()
    def verify_ranks_agree(self) -> None:
        """Raise :class:`zeroimpl.DivergenceError` on every rank unless every rank holds bit-identical
        parameters: the trainable ones and the frozen members of the param groups. Collective: one
        all-reduce of two int64 checksums (wrapping sums of the bits) per bucket and per frozen parameter,
        and one per parameter of a differing bucket to name the first that differs. ``verify_every`` calls
        it after every that-many steps."""
        self.finish_param_gathers()
        frozen = [p.detach().reshape(-1) for p in self._frozen_params]
        sums = torch.stack([_bit_checksum(t) for t in [s.param_buffer for s in self.storages] + frozen])
        same = self._same_on_every_rank(sums)
        differing = [s for s, agree in zip(self.storages, same) if not agree]
        suspects = [(i, p) for s in differing for i, p in zip(s.bucket.param_indices, s.params)]
        if suspects:
            per_param = torch.stack([_bit_checksum(p.detach().reshape(-1)) for _, p in suspects])
            first = next(p for (_, p), agree in zip(suspects, self._same_on_every_rank(per_param)) if not agree)
        elif not all(same):
            first = self._frozen_params[same.index(False, len(self.storages)) - len(self.storages)]
        else:
            return
        raise comm.DivergenceError(
            f"the ranks hold different parameters after step {self._steps_taken}: {self._param_name(first)} "
            f"differs ({same.count(False)} bucket(s) or frozen parameter(s) in all). Data-parallel ranks must stay "
            "identical; usual causes: rank-dependent code that edits parameters, a different model or seed on "
            "some rank, or a corrupted update. Restart from the last checkpoint; if it recurs, find what edits "
            "that parameter")

    def _same_on_every_rank(self, checksums: torch.Tensor) -> list[bool]:
        return self.topology.same_on_every_rank(checksums.to(self._device), self.collective_timeout,
                                                "parameter checksum all-reduce").tolist()

    def _param_name(self, param: torch.Tensor) -> str:
        """A parameter's name (when built from ``model.named_parameters()``) or position, and shape."""
        for group_index, group in enumerate(self.param_groups):
            for position, member in enumerate(group["params"]):
                if member is param:
                    names = group.get("param_names")
                    where = repr(names[position]) if names else f"parameter {position} of param group {group_index}"
                    return f"{where} (shape {tuple(param.shape)})"
        return f"a parameter of shape {tuple(param.shape)}"

    def _finish_step(self, overflow: bool) -> None:
        """The step consumed the gradients, as ``zero_grad()`` would have cleared them: a loop that calls
        ``model.zero_grad()`` (which sees no ``.grad`` to clear) trains as with torch."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.grad_views.discard()
        verdict = self._step_state.verdict
        self.reducer.end_step(stepped=None if verdict is None else verdict.stepped)
        self.gradients.clear(set_to_none=True)
        self._step_state.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_views.discard()
        self.reducer.zero_grad(set_to_none)
        self._step_state.reset()

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state. Local only (no collective): safe to call on one rank alone.

        Tensors are references, as in ``torch.optim.Optimizer.state_dict``.
        """
        self.sync_masters()
        return {
            "format": optimizer_state.STATE_FORMAT,
            "rank": self.rank,
            "layout": self.layout.fingerprint(),
            "strides": [tuple(p.stride()) for p in self.trainable_params],  # the flat order of every shard
            "inner": self.inner.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k not in ("params", "optimizer")}
                             for g in self.param_groups],
            "master_weights": [s.master for s in self.storages] if self._has_separate_master else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    def sync_masters(self) -> None:
        """Bring the master weights up to date with parameters edited outside the optimizer since the last
        step (``step()`` and saving do this themselves). Local: no new collective (it finishes the parameter
        all-gathers still in flight, see ``overlap_param_gather``)."""
        self.finish_param_gathers()
        self.gradients.wait_copies()
        for storage in self.storages:
            storage.sync_master_with_params()

    @property
    def _has_separate_master(self) -> bool:
        return any(s.has_separate_master for s in self.storages)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by ``state_dict()`` of the same rank, world size and parameter layout.

        Collective (call it on every rank, each with its own state): a state that some rank cannot load (another
        rank's, as a checkpoint saved on the master process alone holds) is refused on every rank, before
        anything changes."""
        problem = optimizer_state.load_problem(state_dict, self.rank, self.world_size, self.layout.fingerprint(),
                                               self.trainable_params, len(self.param_groups),
                                               self.loss_scaler is not None)
        optimizer_state.agree_to_load(problem, self.topology, self.collective_timeout)
        self._install_state(state_dict["inner"], state_dict["param_groups"], state_dict["master_weights"],
                            state_dict["loss_scaler"])

    def _install_state(self, inner_state: dict, hyperparameters: list[dict],
                       masters: Optional[list[torch.Tensor]], loss_scaler: Optional[dict]) -> None:
        """Install checked state: the inner optimizer's state dict, each group's hyperparameters (the inner
        optimizer keeps its own kernel choice), optionally the master shards and the loss-scaler state.

        ``masters`` is ``None`` for a state saved without separate masters (an fp32 model without offload):
        then the masters keep following the parameters, which the user loads.
        """
        kernels = [{k: v for k, v in g.items() if k in KERNEL_KEYS} for g in self.inner.param_groups]
        self.finish_param_gathers()  # no all-gather may still write the parameters
        self.gradients.wait_copies()  # no copy may still read the masters
        # the kernel decides where torch puts state such as `step`: use ours, not the saver's, when loading
        inner_state = {**inner_state, "param_groups": [{**g, **kernel} for g, kernel in
                                                       zip(inner_state["param_groups"], kernels)]}
        self.inner.load_state_dict(inner_state)  # moves the state to the masters' device and dtype
        for outer, inner, saved, kernel in zip(self.param_groups, self.inner.param_groups, hyperparameters, kernels):
            outer.update({k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS})
            outer.update(kernel)
            inner.update(kernel)
        if masters is not None:
            with torch.no_grad():
                for storage, master in zip(self.storages, masters):
                    storage.master.copy_(master)
                    storage.mark_master_in_sync()
        if self.loss_scaler is not None and loss_scaler is not None:
            self.loss_scaler.load_state_dict(loss_scaler)

    # -- the checkpoint package's seam -----------------------------------------------------------
    def piece_states(self) -> list[tuple[ShardPiece, torch.Tensor, Optional[dict]]]:
        """This rank's pieces, in ``layout.pieces(rank)`` order, each with its view of the master shard and
        the inner optimizer's state for it (``None``: never stepped)."""
        state = self.inner.state  # (a merged view, built once)
        return [(piece, master, state.get(master)) for piece, master in zip(self._pieces, self._piece_masters)]

    def restore_state(self, piece_states: list[Optional[dict]], hyperparameters: list[dict],
                      masters: Optional[list[torch.Tensor]] = None, loss_scaler: Optional[dict] = None) -> None:
        """Install optimizer state read from a checkpoint or converted from torch's format.

        ``piece_states``: the inner optimizer's state per piece, in :meth:`piece_states` order (``None``: not
        stepped yet); ``hyperparameters``: each param group's. With ``masters`` (per bucket, this rank's
        master shard) the masters are set and every rank's parameters are all-gathered from them: collective,
        call it on every rank. Without, the masters keep following the parameters, which the caller loads
        (local). ``loss_scaler``: a state from ``LossScaler.state_dict()`` (``None``: keep the current one).
        """
        self._install_state(self._inner_state_dict(piece_states, hyperparameters), hyperparameters, masters,
                            loss_scaler)
        if masters is not None:
            self._publish_and_gather()

    def _inner_state_dict(self, piece_states: list[Optional[dict]], hyperparameters: list[dict]) -> dict:
        """A ``state_dict()`` of the inner optimizer (torch's format) from a state per piece (in
        :meth:`piece_states` order; ``None``: not stepped yet) and each param group's hyperparameters."""
        number = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        state = {number[id(master)]: piece_state for master, piece_state in zip(self._piece_masters, piece_states)
                 if piece_state is not None}
        groups = [{**{k: v for k, v in inner.items() if k != "params"},
                   **{k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS},
                   "params": [number[id(p)] for p in inner["params"]]}
                  for saved, inner in zip(hyperparameters, self.inner.param_groups)]
        return {"state": state, "param_groups": groups}

    # -- introspection ----------------------------------------------------------------------------
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for training right now, by kind: ``parameters`` (the bucket buffers
        that the trainable parameters view), ``gradients`` (full ``.grad``), ``gradient_shard`` (on the
        parameters' device) and ``host_gradient_shard`` (offload), ``host_staging`` (offload of a 16-bit
        model: the buffers its masters are converted into on the way to the device), ``master_weights``
        (separate masters only), ``optimizer_state`` and ``bucket_buffers`` (transient reduction buffers). What
        :meth:`memory_report` counts, for tools that count storage themselves."""
        return {
            "parameters": [s.param_buffer for s in self.storages],
            "gradients": self.grad_views.full_gradients(),
            "gradient_shard": self.gradients.device_tensors(),
            "host_gradient_shard": self.gradients.host_tensors(),
            "host_staging": self.gradients.staging_tensors(),
            "master_weights": [s.master for s in self.storages if s.has_separate_master],
            "optimizer_state": [v for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v)],
            "bucket_buffers": self.reducer.live_buffers(),
        }

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, by kind and place (see :class:`zeroimpl.MemoryReport`)."""
        held = {kind: tensor_bytes(tensors) for kind, tensors in self.held_tensors().items()}
        on_host = self.offload is not None  # masters and state live beside each other
        device = StateBytes(
            parameters=held["parameters"],
            gradients=held["gradients"],
            gradient_shard=held["gradient_shard"],
            master_weights=0 if on_host else held["master_weights"],
            optimizer_state=0 if on_host else held["optimizer_state"],
            bucket_buffers=held["bucket_buffers"],
        )
        host = StateBytes(gradient_shard=held["host_gradient_shard"], bucket_buffers=held["host_staging"],
                          master_weights=held["master_weights"] if on_host else 0,
                          optimizer_state=held["optimizer_state"] if on_host else 0)
        return MemoryReport(device, host)


def _weakly(method):
    """A callable that calls ``method`` while its object lives (the hooks' callbacks must not keep the optimizer
    alive: a deleted optimizer lets go of the model)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _bit_checksum(flat: torch.Tensor) -> torch.Tensor:
    """An int64 sum of the bits of a contiguous 1-D tensor, read as integers of the element's width: any one
    changed element changes it (wrapping on overflow)."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(as_int).sum(dtype=torch.int64)


def _norm_dtype(shard: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 gradient shards, fp64 for fp64 ones (torch refuses to narrow in a norm)."""
    return torch.promote_types(shard.dtype, torch.float32)


def _check_whole_groups(groups: list[dict]) -> None:
    """Let torch's whole-parameter classes refuse their groups on every rank alike (torch.optim.Muon: parameters
    that are not 2-D), not only on the rank that owns the offending parameter: build each once over
    shape-only (meta) copies of the group's trainable parameters. (A class of the user's, whose constructor
    may read values, is built over this rank's pieces only.)"""
    for group in groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        if group["optimizer"] in optimizer_kinds.WHOLE_PARAMETER_OPTIMIZERS and trainable:
            hyperparameters = {k: v for k, v in group.items() if k not in OUTER_ONLY_KEYS}
            group["optimizer"]([{**hyperparameters, "params": [torch.empty_like(p, device="meta") for p in trainable]}])
