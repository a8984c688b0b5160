"""ShardedOptimizer: ZeRO stage 1 and 2 around torch optimizers, elementwise (AdamW) or not (Muon, Adafactor).

One optimizer step, as seen from one rank (Ψ trainable elements, N ranks), and the module that does each part::

    backward -> gradients reduce-scattered into this rank's gradient shard (Ψ/N)  [grad_sync]
                kept on the device, or copied to the host with offload              [grad_shards, offload]
                param.grad: a view of the averaged gradient, for torch's utilities  [grad_views]
    step     -> finish the reduction, unscale, agree on NaN/Inf (and the clipping norm) [step_checks]
             -> inner optimizers over this rank's pieces of the master weights       [inner]
             -> masters into the parameter shard, all-gathered bucket by bucket (offload: each bucket's
                host step, copy and all-gather in turn), left in flight into the next forward  [param_sync]

This module builds those parts and runs the step; it calls down into them and none calls back up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, ContextManager, Iterable, Literal, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from . import module_buffers, optimizer_kinds, uneven, validation, verify
from .accounting import MemoryReport, memory_report
from .buffers import BucketStorage, flatten_params
from .grad_sync import GradientReducer
from .grad_views import GradViews
from .inner import PieceMasters, build_on_every_rank, step_pieces
from .layout import ShardLayout, ShardPiece, build_layout, trainable_specs
from .memory_format import contiguous_strides, same_order
from .offload import KERNEL_KEYS, CPUOffload, OffloadOption, gradient_store, inner_kwargs, resolve_offload
from .optimizer_kinds import OUTER_ONLY_KEYS
from .ownership import ModelFollower, Ownership
from .param_sync import ParamSync
from .precision import DynamicLossScaler, LossScaleConfig
from .state_format import (describe_groups, pieces_of_torch_state, place_piece, split_state,
                           torch_optimizer_state)
from .step_checks import StepChecks, nonfinite_message, passes_message
from .topology import Topology, resolve_topology

STATE_FORMAT = "zeroimpl.sharded_optimizer/2"


class _PartSettings(NamedTuple):
    """The constructor's choices that the parts holding the parameters' memory are built from (again, when the
    model moves before the first step)."""

    step_works: list  # per group: the cost of stepping a whole parameter (whole-parameter groups), or None
    blocks: list  # per group: a low-bit class's quantization blocks, or None
    classes: list[type]  # per group: its optimizer class
    optimizer_class: type
    optimizer_kwargs: dict[str, Any]
    bucket_numel: int
    quantize_param_gather: bool
    quantize_grad_reduce: Union[bool, str]
    reduce_dtype: Optional[torch.dtype]
    max_inflight_buckets: int
    loss_scale: Any


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """Shards optimizer state (stage 1) and gradients (stage 2) of ``params`` across data-parallel ranks.

    Args:
        params: parameters or param-group dicts, as any torch optimizer takes. Frozen parameters (``requires_grad=
            False``) are left alone. Rank 0's values overwrite the others' at construction, as DDP's (``init_sync``).
            Stage 2 reduces the gradients itself: call the bare model. Stage 1 also takes a model wrapped in
            DistributedDataParallel (found at the first backward), as torch's ZeroRedundancyOptimizer does: DDP
            averages ``param.grad``, this optimizer steps its shard of it and all-gathers the parameters (3Ψ of
            traffic per step against 2Ψ unwrapped).
            A group may name its own class under ``"optimizer"`` (``{"params": matrices, "optimizer":
            torch.optim.Muon, "lr": 0.02}``); its other keys are that class's hyperparameters.
        optimizer_class: the ``torch.optim.Optimizer`` subclass of the groups that name none. Elementwise classes
            (AdamW, Adam, SGD, ...) get flat shards; Muon, Adafactor and the classes in ``per_parameter`` get
            whole-parameter shards (each parameter stepped whole, by one rank); LBFGS and SparseAdam are refused.
        stage: 1 -- shard optimizer state and master weights; gradients are reduce-scattered once per step.
            2 -- also shard gradients: they are reduce-scattered bucket by bucket during backward.
        offload: ``None``, ``"cpu"`` or :class:`zeroimpl.CPUOffload`: the fp32 master weights, the optimizer state
            and the fp32 gradient shard live in host memory, and the step runs on the CPU (fused where it can). The
            device keeps the parameters and transient buckets. In stage 2, run non-final micro-batches under
            ``optimizer.accumulating()``: they sum on the device and the shard crosses to the host once per step.
        process_group: the data-parallel group (default: the whole world).
        device_mesh: instead of ``process_group``, a ``torch.distributed.DeviceMesh``: 1-D, as its group; 2-D
            (replicate x shard), hybrid sharding. 2-D dims are named ``("replicate", "shard")`` as FSDP2's HSDP, or
            unnamed: state (and, in stage 2, gradients) sharded within each shard group (typically one node),
            replicated across the replicate group: reduce-scatter in the shard group, all-reduce of the shard
            across replicas, all-gather in the shard group, so that the traffic between replicas is an all-reduce
            of Ψ/n elements, 2Ψ/n per rank (n: shard-group size), instead of DDP's 2Ψ. ``rank`` and
            ``world_size`` then describe the shard group; ``topology`` describes both.
        bucket_numel: elements per gradient/parameter bucket (default 2**22, 16 MiB of fp32).
        max_inflight_buckets: reduce-scatters (hybrid: and replica all-reduces) in flight before backward waits for
            the oldest (default 2; 0: each at once): bounds the buffers alive during backward.
        reduce_dtype: dtype in which gradients are reduced and their shard kept (default fp32; fp64 for fp64 models).
            Under loss scaling a 16-bit shard is unscaled in fp32 (kept so until ``zero_grad()``), as DeepSpeed
            unscales its fp32 gradient partition.
        loss_scale: dynamic loss scaling. ``"auto"`` (default): on when any parameter is fp16. A
            :class:`LossScaleConfig`: on with those settings (fp16 autocast over fp32 parameters). ``None``: off.
            When on, call ``optimizer.backward(loss)`` (or ``optimizer.scale_loss(loss).backward()``) instead
            of ``loss.backward()``; steps whose gradients overflow are skipped and the scale backs off.
        verify_every: every this many steps, compare a checksum of the parameters across ranks (one small
            all-reduce) and raise :class:`zeroimpl.DivergenceError` naming the first that differs (``None``: never).
        nonfinite: ``"raise"`` or ``"skip"``: what ``step()`` does when the averaged gradients hold NaN or Inf and
            no loss scaling is on (or the scale is at its minimum). ``"raise"`` (default): clear the gradients,
            leave parameters and state untouched, and raise ``FloatingPointError`` on every rank. ``"skip"``: clear
            the gradients, skip the step and count it in ``skipped_steps``. Never an update with NaN.
        collective_timeout: seconds any one of this optimizer's collectives on CPU tensors (gloo) may take before
            it raises :class:`zeroimpl.CollectiveError` (a rank died or hangs). On CUDA: the waits where the host
            blocks anyway (:mod:`zeroimpl.pending`). ``None`` (default): the process group's timeout.
        overlap_param_gather: leave each bucket's parameter all-gather in flight at the end of ``step()``
            (default ``True``). The first torch operation or module forward that touches one of its parameters
            waits for it (see :mod:`zeroimpl.inflight`, and for the reads it cannot see
            :meth:`finish_param_gathers` or ``False``). Results are bitwise those of ``False``.
        quantize_param_gather: all-gather each step's change of the parameters in 8 bits (every rank adds the same
            dequantized change; each keeps an exact fp32 master of its shard): :mod:`zeroimpl.quantized_comm`.
        quantize_grad_reduce: reduce the gradients in 8 bits, summed in fp32 (``"replicas"``: only across replicas).
        assume_elementwise: shard unknown classes flat (only if they update each element from its own values alone).
        per_parameter: optimizer classes to shard by whole parameters (a Shampoo or SOAP implementation, or any
            class whose update of a parameter needs all of it), besides Muon and Adafactor.
        init_sync: ``"broadcast"`` (default) or ``"check"``: rank 0's ``params`` overwrite every rank's at
            construction, as DDP does (buffers: :func:`zeroimpl.sync_buffers`), or a difference raises on every rank.
        **optimizer_kwargs: passed to ``optimizer_class`` (lr, weight_decay, betas, ...).

    Invariant: every rank holds the same parameters after ``step()``; rank r's inner optimizers hold state
    for chunk r of every bucket only.
    """

    def __init__(self, params: Union[Iterable[torch.Tensor], Iterable[dict]], optimizer_class: type,
                 stage: Literal[1, 2] = 2, *, offload: OffloadOption = None,
                 process_group: Optional[dist.ProcessGroup] = None, device_mesh=None,
                 bucket_numel: int = 2 ** 22, max_inflight_buckets: int = 2, reduce_dtype: Optional[torch.dtype] = None,
                 loss_scale: Union[Literal["auto"], None, LossScaleConfig] = "auto",
                 nonfinite: Literal["raise", "skip"] = "raise",
                 collective_timeout: Optional[float] = None, assume_elementwise: bool = False,
                 per_parameter: Collection[type] = (), verify_every: Optional[int] = None,
                 overlap_param_gather: bool = True, quantize_param_gather: bool = False,
                 quantize_grad_reduce: Union[bool, Literal["replicas"]] = False,
                 init_sync: Literal["broadcast", "check"] = "broadcast", **optimizer_kwargs):
        quantized = {"quantize_param_gather": bool(quantize_param_gather), "quantize_grad_reduce": quantize_grad_reduce}
        validation.refuse_peer_arguments(optimizer_kwargs)
        validation.check_options(stage, loss_scale, nonfinite, collective_timeout, max_inflight_buckets, verify_every,
                                 quantized, init_sync)
        self.collective_timeout = collective_timeout
        self.offload: Optional[CPUOffload] = resolve_offload(offload)
        groups, step_works, blocks = optimizer_kinds.plan(params, optimizer_class, optimizer_kwargs, per_parameter,
                                                          assume_elementwise)
        classes = [group["optimizer"] for group in groups]
        validation.check_process_group(process_group)
        self.verify_every, self.overlap_param_gather = verify_every, bool(overlap_param_gather)
        self._steps_taken, self._constructed = 0, False  # updates applied (skipped steps do not count)
        self._consolidated: Optional[dict] = None  # consolidate_state_dict's full state, on its rank, until a change
        self._loaded = False  # state was installed (load_state_dict, a checkpoint): a rebuild carries it over
        super().__init__(groups, {})  # refuses duplicates
        Joinable.__init__(self)  # under torch's Join: uneven inputs raise on every rank (zeroimpl/uneven.py)
        self.topology: Topology = resolve_topology(process_group, device_mesh, self.param_groups, collective_timeout)

        self.stage, self.process_group = stage, self.topology.shard  # reduce-scatter and all-gather run here
        self.rank, self.world_size = self.topology.shard_rank, self.topology.shard_size
        self.nonfinite, self._skipped_without_scaler = nonfinite, 0
        self._settings = _PartSettings(step_works, blocks, classes, optimizer_class, optimizer_kwargs, bucket_numel,
                                       bool(quantize_param_gather), quantize_grad_reduce, reduce_dtype,
                                       max_inflight_buckets, loss_scale)
        trainable, layout = self._lay_out()
        # the layout depends on each group's class and kind too: ranks must agree on it, not only on the params
        validation.check_params(trainable, self.topology, collective_timeout, {**layout.fingerprint(), **quantized},
                                values=init_sync == "check")
        members = [p for g in self.param_groups for p in g["params"]]  # frozen ones too
        optimizer_kinds.check_whole_groups(self.param_groups, OUTER_ONLY_KEYS)
        self.ownership = Ownership(trainable, [p for p in members if not p.requires_grad])  # frozen: out of the layout
        if init_sync == "broadcast":  # once this optimizer owns them, before they move into its buffers
            module_buffers.broadcast_parameters(members, self.topology, collective_timeout)
        self._build_parts(trainable, layout, agree=True)
        self._constructed = True
        # until the first step, a model moved, converted or given new parameters is followed (:meth:`_follow_model`)
        self._follower: Optional[ModelFollower] = ModelFollower(self._follow_model, self.ownership)
        self._follower.remember(self.trainable_params)

    def _lay_out(self) -> tuple[list[torch.nn.Parameter], ShardLayout]:
        """The trainable parameters of the groups as they are now, and their shard layout."""
        settings = self._settings
        trainable, specs = trainable_specs(self.param_groups, settings.step_works, settings.blocks)
        return trainable, build_layout(specs, self.world_size, settings.bucket_numel)

    def _build_parts(self, trainable: list[torch.nn.Parameter], layout: ShardLayout, agree: bool) -> None:
        """Build the parts that hold the parameters' memory from ``trainable`` as they are now: flat buffers,
        masters, gradient store, inner optimizers, hooks. ``agree``: the inner optimizers' construction is agreed
        across the ranks (at construction; a rebuild before the first step is local, as the move that caused it)."""
        settings, timeout = self._settings, self.collective_timeout
        self.trainable_params: list[torch.nn.Parameter] = trainable  # indexed by layout parameter index
        self.layout: ShardLayout = layout
        self._device = trainable[0].device
        self.host_arenas, host_masters, self.gradients, staging = gradient_store(self.offload, layout, trainable,
                                                                                timeout)
        self.storages: list[BucketStorage] = flatten_params(layout, trainable, self.rank, host_masters,
                                                            settings.quantize_param_gather)
        self.param_sync = ParamSync(self.storages, self.topology, staging)
        self.pieces = PieceMasters(layout, layout.pieces(self.rank), self.storages, trainable)
        self.inner = build_on_every_rank(self.pieces.inner_groups(self.param_groups), settings.classes,
                                         inner_kwargs(settings.classes, settings.optimizer_class,
                                                      settings.optimizer_kwargs, self.param_groups, self.offload),
                                         self.topology if agree else None, timeout, trainable)
        self.inner.fill_defaults(self.param_groups)
        self.defaults = self.inner.defaults

        self.loss_scaler: Optional[DynamicLossScaler] = DynamicLossScaler.resolve(settings.loss_scale, trainable)
        self.uneven = uneven.UnevenInputs(self, self.join_device, self.join_process_group, timeout)
        self.reducer = GradientReducer(layout=layout, storages=self.storages, topology=self.topology, stage=self.stage,
                                       reduce_dtype=settings.reduce_dtype, max_inflight=settings.max_inflight_buckets,
                                       gradients=self.gradients, uneven=self.uneven,
                                       quantized=settings.quantize_grad_reduce)
        self.checks = StepChecks(reducer=self.reducer, ownership=self.ownership, uneven=self.uneven,
                                 loss_scaler=self.loss_scaler, topology=self.topology, device=self._device)
        # param.grad after backward: views of the averaged gradient, exposed by the reducer's end of backward
        self.grad_views = GradViews(params=trainable, pieces=self.pieces.pieces, checks=self.checks,
                                    topology=self.topology)
        self.reducer.call_after_backward(self.grad_views.after_backward)

    def _follow_model(self) -> None:
        """Before the first step, take the parameters as the model now holds them, as a torch optimizer built before
        ``model.to(device)``, ``.half()``, ``load_state_dict(assign=True)`` or a framework's placement would:
        rebuild the flat buffers, masters and inner optimizers from the moved, converted or replacing parameters.
        State loaded before the change (``load_state_dict``, ``zeroimpl.checkpoint.load_checkpoint``) is carried over
        (inner state, masters, loss scale) where the parameters keep their pieces; where a conversion changed the
        layout it is refused. Local (every rank moves its model alike), but for the parameters' all-gather from
        carried masters. Once a step has run, or gradients are held, nothing is followed: the step refuses a changed
        model (:meth:`Ownership.check_unchanged`)."""
        if self._follower is None:
            return
        successors = self.ownership.successors()
        if not successors and not any(storage.rebound_params() for storage in self.storages):
            return
        if self.reducer.backward_passes or self.gradients.has_gradients or self._steps_taken:
            return  # (gradients of the old parameters: the step's check names the change)
        self.param_sync.finish_param_sync()
        carried = self._carried_state() if self._loaded else None
        for group in self.param_groups:
            group["params"] = [successors.get(id(p), p) for p in group["params"]]
        trainable, layout = self._lay_out()
        validation.check_moved_params(trainable, self.process_group)
        self.topology = dataclasses.replace(self.topology, device=trainable[0].device)  # (NCCL's object collectives)
        members = [p for g in self.param_groups for p in g["params"]]
        self.reducer.remove_hooks()
        self.grad_views.remove_hooks()
        self.ownership.release()
        self.ownership = Ownership(trainable, [p for p in members if not p.requires_grad])
        self._follower.ownership = self.ownership
        self._build_parts(trainable, layout, agree=False)
        self._follower.remember(trainable)
        if carried is not None:
            self._carry_over(*carried)

    def _carried_state(self) -> tuple:
        """What a rebuild keeps of state loaded into this optimizer: its pieces' positions and inner state, the
        masters and the loss-scaler state."""
        pieces = self.pieces.states(self.inner)
        return (_positions(p for p, _, _ in pieces),
                [state for _, _, state in pieces], [s.master for s in self.storages],
                self.loss_scaler.state_dict() if self.loss_scaler else None)

    def _carry_over(self, positions: list, states: list, masters: list, loss_scaler: Optional[dict]) -> None:
        """Install state carried over a rebuild (:meth:`_carried_state`) into the rebuilt parts."""
        sizes = [s.master.numel() for s in self.storages]
        if _positions(self.layout.pieces(self.rank)) != positions or [m.numel() for m in masters] != sizes:
            raise RuntimeError("the model was converted after optimizer state was loaded into the ShardedOptimizer, "
                               "and the conversion changed how the parameters are laid out in its buckets (their "
                               "dtypes), so the loaded state no longer fits its shards: convert the model first, then "
                               "load the state (or the checkpoint)")
        self.restore_state(states, [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                           masters=masters, loss_scaler=loss_scaler)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, stage: Literal[1, 2] = 2, **options):
        """A ShardedOptimizer of a torch ``optimizer``'s class, groups and defaults (``options``: its own keywords),
        before that steps; ``optimizer``'s groups become this one's (for its LR schedulers) and its step() raises."""
        groups, optimizer_class, defaults = optimizer_kinds.settings_of(optimizer)
        return optimizer_kinds.hand_over(optimizer, cls(groups, optimizer_class, stage, **{**defaults, **options}))

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction: the shard layout is fixed."""
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
        """Steps skipped (or raised) for NaN/Inf gradients: saved with the loss scaler, else since construction."""
        return self.loss_scaler.skipped_steps if self.loss_scaler else self._skipped_without_scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (fp32), for a backward the caller runs; the loss itself without scaling."""
        if self.loss_scaler is None:
            return loss
        self.checks.note_loss_scaled()
        return loss.float() * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()``, with the loss multiplied by the loss scale when loss scaling is on."""
        self.scale_loss(loss).backward(**backward_kwargs)

    def accumulating(self) -> ContextManager[None]:
        """Mark the backward passes inside as non-final micro-batches (a hint: offload sums them on the device)."""
        return self.gradients.accumulating()

    # -- torch.distributed.algorithms.Join ---------------------------------------------------------
    def join_hook(self, **kwargs) -> uneven.RefuseUnevenInputs:
        """Under ``Join``, a rank that ran out of data makes every rank raise ``UnevenInputsError``."""
        return uneven.RefuseUnevenInputs(self.join_device, self.join_process_group, self.collective_timeout)

    @property
    def join_device(self) -> torch.device:  # where the Join flags live
        return self._device

    @property
    def join_process_group(self):
        """The group of every rank that steps with this optimizer (the world under hybrid sharding)."""
        return self.process_group if self.topology.replicate is None else dist.group.WORLD

    # -- gradients --------------------------------------------------------------------------------
    def _agree(self, norm_type: Optional[float] = None) -> Optional[torch.Tensor]:
        """The step's agreement all-reduce (:meth:`StepChecks.agree`) unless its verdict stands (a norm read through
        ``param.grad`` carried it) and no norm is asked for; raises on every rank (gradients cleared) when ranks ran
        different numbers of backward passes."""
        stands = norm_type is None and self.checks.verdict_stands()
        total = None if stands else self.checks.agree(norm_type)
        if not self.checks.verdict.same_passes:
            passes = self.reducer.backward_passes
            self.zero_grad()
            raise RuntimeError(passes_message(passes))
        return total

    def found_nonfinite(self) -> bool:
        """Whether this step's averaged gradients hold NaN or Inf on any rank, so that ``step()`` will skip (or raise:
        ``nonfinite``). Same on every rank; collective: the step's small all-reduce, which ``step()`` reuses."""
        self._follow_model()
        with torch.no_grad():
            if not self.grad_views.prepare():
                return False
            self._agree()
        return self.checks.verdict.nonfinite

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients of the whole model to ``max_norm``; return their total norm, as
        ``torch.nn.utils.clip_grad_norm_`` over the full averaged gradients, from the shards with the step's one
        small all-reduce, identical on every rank. NaN/Inf gradients stay unclipped (``step()`` skips or raises);
        ``max_norm=inf`` reads the norm and leaves the gradients untouched.
        Under DDP, whose ``param.grad`` is the full averaged gradient on every rank: ``torch.nn.utils.clip_grad_norm_``
        over it, with no communication (bitwise DDP + torch's clipping)."""
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        self._follow_model()
        if self.reducer.under_ddp:
            return torch.nn.utils.clip_grad_norm_([p for p in self.trainable_params if p.grad is not None], max_norm,
                                                  norm_type)
        if not self.grad_views.prepare():
            return torch.zeros((), device=self._device)
        total = self._agree(norm_type)
        clips = max_norm != float("inf")  # (inf: the norm alone, as Trainer logs it; scaling by 1.0 is a no-op)
        if clips and not self.checks.verdict.nonfinite and self.checks.scale_to_norm(max_norm, total):
            self.grad_views.changed()
        return total

    # -- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Update the parameters from the averaged gradients (or skip: see ``nonfinite``). Collective. Its phases
        in order: the masters brought up to date; the reduction finished and unscaled; the agreement; the pieces
        stepped; the parameters published and all-gathered; the step's end."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._follow_model()
        # the masters are the step's to write: the last step's all-gathers finished (one that failed raises here),
        # parameters written outside the optimizer since taken in
        self.param_sync.finish_param_sync(take_edits=True)
        if not self.grad_views.prepare():  # the reduction finished and unscaled: False when no rank has gradients
            return loss
        self._agree()  # the step's one small all-reduce: same passes, NaN/Inf, which parameters have gradients
        if self.checks.verdict.nonfinite:
            self._skip_step()
            return loss
        pairs = self._pieces_to_step()
        in_parts = self.offload is not None and self.inner.steps_in_parts  # the pipeline: a host step per bucket
        step_pieces(self.inner, [] if in_parts else [pair for bucket in pairs.values() for pair in bucket])
        self.param_sync.start_param_sync(overlap=True, step_bucket=(  # guarded: a failed landing raises at each read
            lambda storage: step_pieces(self.inner, pairs.get(storage.bucket.index, []))) if in_parts else None)
        self.inner.report(self.param_groups)
        self._steps_taken += 1
        self._finish_step(overflow=False)
        if not self.overlap_param_gather:
            self.param_sync.finish_param_sync()  # after the step's bookkeeping
        if self.verify_every and self._steps_taken % self.verify_every == 0:
            self.verify_ranks_agree()
        return loss

    def _pieces_to_step(self) -> dict[int, list]:
        """By bucket index, this rank's (master piece, gradient piece) pairs to step, the hyperparameters the inner
        optimizers step with followed."""
        self.inner.follow(self.param_groups)  # hyperparameters the user (or a scheduler) changed
        grads = [None if grad is None else grad.to(storage.master.dtype)
                 for storage, grad in zip(self.storages, self.gradients.ready())]
        return self.pieces.gradient_pairs(grads, self.checks.verdict.stepped)

    def _skip_step(self) -> None:
        """NaN/Inf gradients: discard them, count the skip, back the loss scale off; raise where ``nonfinite`` says
        so and no smaller loss scale is left to try."""
        raises = self.nonfinite == "raise" and (
            self.loss_scaler is None or self.loss_scaler.scale <= self.loss_scaler.config.min_scale)
        self.reducer.zero_grad(set_to_none=True)
        if self.loss_scaler is None:
            self._skipped_without_scaler += 1
        self._finish_step(overflow=True)
        if raises:
            raise FloatingPointError(nonfinite_message(self.loss_scale))

    def _finish_step(self, overflow: bool) -> None:
        """The step consumed the gradients, as ``zero_grad()`` would clear them (``model.zero_grad()`` sees none)."""
        self._consolidated = None  # (the state it holds is no longer this optimizer's)
        if self._follower is not None:  # from now on the model must stay where the optimizer holds it
            self._follower.close()
            self._follower = None
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._reset_gradients(consumed_by_step=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: forget the gradients (``set_to_none=False``: keep zeros, stepped as zeros)."""
        self._reset_gradients(consumed_by_step=False, set_to_none=set_to_none)

    def _reset_gradients(self, consumed_by_step: bool, set_to_none: bool = True) -> None:
        """The one reset of a round of gradients, in the order its parts depend on: the views out of ``.grad``;
        the reducer's counters, round and gradient store (``end_step`` after a step consumed them, remembering
        which parameters it stepped, else ``zero_grad``); then the step checks, which record the reducer's
        counters afresh (before it, the next backward would look like no backward)."""
        self.grad_views.discard()
        if consumed_by_step:
            verdict = self.checks.verdict
            self.reducer.end_step(stepped=None if verdict is None else verdict.stepped)
        else:
            self.reducer.zero_grad(set_to_none)
        self.checks.reset()

    # -- schedule-free modes --------------------------------------------------------------------------
    def train(self) -> None:
        """Schedule-free optimizers' ``train()``, called before training (HF Trainer calls it): see :meth:`eval`."""
        self._switch_mode("train")

    def eval(self) -> None:
        """Schedule-free optimizers' switch of the parameters to the averaged point for evaluation (``train()``
        switches back), as under DDP: collective when an inner class has the method (its master shards move,
        then the parameters are all-gathered from them); nothing for other classes."""
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        self.sync_masters()
        if self.inner.switch_mode(mode, self.param_groups):
            self.param_sync.start_param_sync()

    # -- parameters -------------------------------------------------------------------------------
    def finish_param_gathers(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the parameter all-gathers still in flight (``overlap_param_gather``), of ``buckets`` or of all:
        then the parameters hold this step's values. Local: every rank issued them in ``step()``."""
        self.param_sync.finish_param_sync(buckets)

    def trains(self, module: torch.nn.Module) -> bool:
        """Whether a parameter of ``module`` is in this optimizer's param groups (frozen ones too: a parameter
        frozen after construction stays the optimizer's): which optimizer a framework's module belongs to, for
        its accumulation and its checkpoint."""
        held = {id(p) for group in self.param_groups for p in group["params"]}
        return any(id(p) in held for p in module.parameters())

    @property
    def param_gathers_in_flight(self) -> int:
        """How many buckets' parameter all-gathers are still in flight (``overlap_param_gather``)."""
        return len(self.param_sync.gathers)

    def sync_masters(self) -> None:
        """Take parameters edited since the last step into the master weights (local: ends the gathers in flight)."""
        self._follow_model()
        self.param_sync.finish_param_sync(take_edits=True)

    @torch.no_grad()
    def verify_ranks_agree(self) -> None:
        """Raise :class:`zeroimpl.DivergenceError` on every rank unless all hold bit-identical parameters (trainable
        and frozen members of the groups). Collective: one small all-reduce of checksums (:mod:`zeroimpl.verify`)."""
        self.finish_param_gathers()
        verify.verify_ranks_agree(self.storages, self.ownership.frozen, self.topology, self._device,
                                  self.collective_timeout, self._steps_taken,
                                  lambda param: verify.param_name(self.param_groups, param))

    # -- state ------------------------------------------------------------------------------------
    # Each rank's state holds that rank's shard only. A loop that saves ``optimizer.state_dict()`` on the master
    # process alone (nanoGPT, many scripts written for DDP) hands rank 0's shard to every rank at resume: the rank
    # that can load it must not go on into the next collective while another refuses, or the job hangs. So a load
    # gathers every rank's verdict (one small object all-gather) and raises the same refusal on every rank.
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full, unsharded state on rank ``to`` (of the shard group; with hybrid sharding on that rank of
        every replica), as torch's ZeroRedundancyOptimizer does: its :meth:`state_dict` then returns it in
        ``torch.optim.Optimizer.state_dict()`` format, loadable by the plain inner optimizer over the same param
        groups (and by :meth:`load_state_dict` at any world size), until the next step or load. Collective; the
        other ranks send their state and keep none. Lightning calls it before it checkpoints an optimizer."""
        self.sync_masters()
        whole = [bucket.whole or bool(bucket.block) for bucket in self.layout.buckets]
        split = [(piece, *(_on_host(part) for part in split_state(state, tuple(master.shape),
                                                                  whole[piece.bucket_index], master.stride())))
                 for piece, master, state in self.piece_states()]
        gathered = self.topology.gather_objects(split, to, self.collective_timeout, "state dict consolidation")
        self._consolidated = None if gathered is None else self._full_state(gathered)

    def _full_state(self, gathered: list[list[tuple]]) -> dict:
        """The full state in torch's format from every shard rank's split pieces (:meth:`consolidate_state_dict`)."""
        params = self.trainable_params
        states: list[dict] = [{} for _ in params]
        scalars: list[Optional[dict]] = [None] * len(params)
        for split in gathered:
            for piece, per_element, piece_scalars, piece_level in split:
                if per_element is None:
                    continue  # (never stepped)
                place_piece(states[piece.param_index], params[piece.param_index].numel(), piece, per_element,
                            piece_level, self.layout.buckets[piece.bucket_index].block)
                scalars[piece.param_index] = scalars[piece.param_index] or piece_scalars
        full = torch_optimizer_state(describe_groups(self), [tuple(p.shape) for p in params],
                                     [p.stride() for p in params], states, scalars)
        if self.loss_scaler is not None:
            full["loss_scaler"] = self.loss_scaler.state_dict()
        return full

    def state_dict(self) -> dict:
        """This rank's state (tensors by reference, as torch's): the inner optimizers' state over the pieces, each
        group's hyperparameters, the master shards when they are separate from the parameters, and the loss
        scaler's state. Local only: safe to call on one rank alone. After :meth:`consolidate_state_dict`, on its
        rank ``to`` and until the next step or load: the full state it gathered, in torch's format. Under DDP
        (stage 1), as torch's ZeroRedundancyOptimizer: only that, and a ``RuntimeError`` otherwise (a framework saving
        the main process's ``state_dict()`` alone would keep one rank's shard)."""
        if self._consolidated is not None:  # its hyperparameters as they are now (a scheduler may have moved them)
            groups = [{**described["hyperparameters"], "params": saved["params"]}
                      for described, saved in zip(describe_groups(self), self._consolidated["param_groups"])]
            return {**self._consolidated, "param_groups": groups}
        if self.reducer.under_ddp:
            raise RuntimeError(validation.ddp_state_dict_message())
        self.sync_masters()
        separate = any(s.has_separate_master for s in self.storages)
        quantized = any(s.blocks is not None for s in self.storages)
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "layout": self.layout.fingerprint(),
            "strides": [tuple(p.stride()) for p in self.trainable_params],  # the flat order of every shard
            "inner": self.inner.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k not in ("params", "optimizer")}
                             for g in self.param_groups],
            "master_weights": [s.master for s in self.storages] if separate else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "quantize_param_gather": quantized,
            "published_shards": [s.published for s in self.storages] if quantized else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by ``state_dict()`` of the same rank, world size and parameter layout, or a full
        state in ``torch.optim.Optimizer.state_dict()`` format (:meth:`consolidate_state_dict`'s, or a plain torch
        optimizer's over the same param groups and classes), given to every rank, at any world size: each rank takes
        its shard, and the master weights follow the parameters (load the model first). Collective: a state some
        rank cannot load (another rank's, as a checkpoint saved on the master process alone holds) is refused on
        every rank, before anything changes."""
        self._follow_model()
        self._consolidated = None
        if _is_torch_format(state_dict):
            self._load_full(state_dict)
            return
        self._agree_to_load(self._load_problem(state_dict))
        self._install(state_dict["inner"], state_dict["param_groups"], state_dict["master_weights"],
                      state_dict["loss_scaler"])
        # a quantized all-gather's next step starts from the parameters as saved: the model loads them, before or
        # after (a state without them, from before zeroimpl sent changes, published the dequantized masters)
        for storage in (s for s in self.storages if s.blocks is not None):
            saved = state_dict.get("published_shards")
            storage.published.copy_(saved[storage.bucket.index] if saved else
                                    storage.blocks.decoded(storage.blocks.encode(storage.master)))

    def _load_full(self, state_dict: dict) -> None:
        """Load a full state in torch's format (see :meth:`load_state_dict`), refused on every rank if some rank
        cannot split it."""
        pieces = [(piece, master) for piece, master, _ in self.piece_states()]
        problem, split = None, None
        try:
            split = pieces_of_torch_state(state_dict, describe_groups(self), self.trainable_params, self.layout, pieces)
        except (ValueError, KeyError, TypeError, IndexError) as error:  # (a damaged or foreign state dict)
            problem = f"the full optimizer state cannot be loaded: {type(error).__name__}: {error}"
        self._agree_to_load(problem)
        self.restore_state(*split, loss_scaler=state_dict.get("loss_scaler"))

    def _agree_to_load(self, problem: Optional[str]) -> None:
        """Raise the same refusal on every rank unless every rank can load its state (``problem``: why this one
        cannot, or None). Collective: one small object all-gather of the verdicts."""
        problems = self.topology.all_gather_objects(problem, self.collective_timeout, "state dict agreement")
        if problem is not None:
            raise ValueError(problem)
        refused = next(((rank, text) for rank, text in enumerate(problems) if text is not None), None)
        if refused is not None:
            raise ValueError(f"rank {refused[0]} (in all-gather order) refused its optimizer state, so no rank loads "
                             f"one: {refused[1]}")

    def _load_problem(self, state_dict) -> Optional[str]:
        """Why this rank cannot load ``state_dict``; None if it can. Local."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            return (f"not a ShardedOptimizer state dict (missing format tag {STATE_FORMAT!r}); a plain torch "
                    "optimizer state needs the checkpoint API")
        fingerprint = self.layout.fingerprint()
        if state_dict["rank"] != self.rank or state_dict["layout"] != fingerprint:
            return (f"this state was saved by rank {state_dict['rank']} with world size "
                    f"{state_dict['layout']['world_size']}"
                    f"{'' if state_dict['layout'] == fingerprint else ' and another parameter layout'}; this "
                    f"optimizer is rank {self.rank} of {self.world_size}. Each rank holds its own shard of the "
                    "optimizer state: save optimizer.state_dict() on every rank (not on the master process alone) "
                    "and load each rank's own, with the same model, param groups, world size and bucket settings, "
                    "or use zeroimpl.checkpoint.save_checkpoint / load_checkpoint (which also reshard to another "
                    "world size)")
        params = self.trainable_params
        saved = state_dict.get("strides") or [contiguous_strides(p.shape) for p in params]
        for index, (strides, param) in enumerate(zip(saved, params)):
            if not same_order(param.shape, strides, param.stride()):
                return (f"trainable parameter {index} {tuple(param.shape)} was saved in the memory format of strides "
                        f"{tuple(strides)} but has strides {tuple(param.stride())} here, so its shard would be read "
                        "in the wrong order: give the parameters the memory format they had when saved before "
                        "building the optimizer (model.to(memory_format=...); a state saved before zeroimpl kept "
                        "memory formats holds every parameter contiguous: p.data = p.data.contiguous())")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            return "the state has a different number of param groups"
        if (state_dict["loss_scaler"] is None) == (self.loss_scaler is not None):
            return "the state's loss scaler does not match this optimizer (loss scaling on in one, off in the other)"
        quantized = any(s.blocks is not None for s in self.storages)
        if state_dict.get("quantize_param_gather", False) != quantized:
            return (f"the state was saved with quantize_param_gather={not quantized} and this optimizer has "
                    f"{quantized}: the model's saved parameters are within a quantization step of the masters in one "
                    "and the masters in the other, so the ranks would hold different parameters; switch through "
                    "zeroimpl.checkpoint (save_checkpoint / load_checkpoint), which all-gathers the parameters from "
                    "the saved masters")
        return None

    # -- the checkpoint package's seam -----------------------------------------------------------
    def piece_states(self) -> list[tuple[ShardPiece, torch.Tensor, Optional[dict]]]:
        """This rank's pieces, in ``layout.pieces(rank)`` order, each with its view of the master shard and
        the inner optimizer's state for it (``None``: never stepped)."""
        self._follow_model()
        return self.pieces.states(self.inner)

    def restore_state(self, piece_states: list[Optional[dict]], hyperparameters: list[dict],
                      masters: Optional[list[torch.Tensor]] = None, loss_scaler: Optional[dict] = None,
                      published: Optional[list[torch.Tensor]] = None) -> None:
        """Install optimizer state read from a checkpoint or converted from torch's format. ``piece_states``: the
        inner state per piece, in :meth:`piece_states` order (``None``: not stepped yet); ``hyperparameters``:
        each param group's. With ``masters`` (per bucket, this rank's master shard) the parameters are
        all-gathered, unquantized, from them or from ``published`` (per bucket, this rank's shard of the
        parameters as saved: a quantized all-gather's): collective. Without, the masters follow the parameters,
        which the caller loads (local). ``loss_scaler``: a ``LossScaler.state_dict()`` (``None``: keep it)."""
        self._follow_model()
        number = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        state = {number[id(master)]: piece_state for master, piece_state in zip(self.pieces.masters, piece_states)
                 if piece_state is not None}
        groups = [{**{k: v for k, v in own.items() if k != "params"},
                   **{k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS},
                   "params": [number[id(p)] for p in own["params"]]}
                  for saved, own in zip(hyperparameters, self.inner.param_groups)]
        self._install({"state": state, "param_groups": groups}, hyperparameters, masters, loss_scaler)
        if masters is not None:
            self.param_sync.start_param_sync(exact=True, saved_shards=published)

    def _install(self, inner_state: dict, hyperparameters: list[dict], masters: Optional[list[torch.Tensor]],
                 loss_scaler_state: Optional[dict]) -> None:
        """Install checked state (``inner_state``: the inner optimizers' state dict, torch's format): each group's
        hyperparameters (the inner optimizers keep their own kernel choice), optionally the master shards and the
        loss-scaler state. ``masters`` is ``None`` for a state saved without separate masters (an fp32 model
        without offload): then the masters keep following the parameters, which the user loads."""
        self.param_sync.finish_param_sync()  # no all-gather may still write the parameters, no copy read the masters
        self._loaded = True
        self._consolidated = None  # (the state it holds is no longer this optimizer's)
        kernels = [{k: v for k, v in g.items() if k in KERNEL_KEYS} for g in self.inner.param_groups]
        # the kernel decides where torch puts state such as `step`: use ours, not the saver's, when loading
        inner_state = {**inner_state, "param_groups": [{**g, **kernel} for g, kernel in
                                                       zip(inner_state["param_groups"], kernels)]}
        self.inner.load_state_dict(inner_state)  # moves the state to the masters' device and dtype
        for outer, own, saved, kernel in zip(self.param_groups, self.inner.param_groups, hyperparameters, kernels):
            # the saved outer groups are the newer: they mirror the inner ones after each step, and a scheduler
            # may have changed them since (its lr goes into the inner group at the next step)
            outer.update({k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS})
            own.update({k: v for k, v in saved.items() if k not in OUTER_ONLY_KEYS | KERNEL_KEYS})
            outer.update(kernel)
            own.update(kernel)
        if masters is not None:
            with torch.no_grad():
                for storage, master in zip(self.storages, masters):
                    storage.master.copy_(master)
                    storage.mark_master_in_sync()
        if self.loss_scaler is not None and loss_scaler_state is not None:
            self.loss_scaler.load_state_dict(loss_scaler_state)
        self.inner.report(self.param_groups)

    # -- introspection ----------------------------------------------------------------------------
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors now, by :class:`zeroimpl.StateBytes`'s kinds: what :meth:`memory_report` counts."""
        return {
            "parameters": [s.param_buffer for s in self.storages]
            + [s.published for s in self.storages if s.published is not None],
            "gradients": self.grad_views.full_gradients(),
            "gradient_shard": self.gradients.device_tensors(),
            "host_gradient_shard": self.gradients.host_tensors(),
            "host_staging": [t for buffers in self.param_sync.staging.values() for t in buffers],
            "master_weights": [s.master for s in self.storages if s.has_separate_master],
            "optimizer_state": [v for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v)],
            "bucket_buffers": self.reducer.live_buffers() + self.param_sync.live_buffers(),
        }

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, by kind and place (see :class:`zeroimpl.MemoryReport`)."""
        return memory_report(self.held_tensors(), offload=self.offload is not None)


def _is_torch_format(state_dict) -> bool:
    """Whether ``state_dict`` is a full state in ``torch.optim.Optimizer.state_dict()`` format (no zeroimpl tag)."""
    return isinstance(state_dict, dict) and "format" not in state_dict and {"state", "param_groups"} <= state_dict.keys()


def _positions(pieces) -> list[tuple[int, int, int, int]]:
    """Where each piece lies: (parameter index, start, end in the parameter, bucket index)."""
    return [(p.param_index, p.param_start, p.param_end, p.bucket_index) for p in pieces]


def _on_host(part):
    """A split piece state's part with its tensors on the host, to be sent (``None`` stays ``None``)."""
    if part is None:
        return None
    return {key: value.detach().cpu() if torch.is_tensor(value) else value for key, value in part.items()}
