"""ShardedOptimizer: ZeRO stage 1 and 2 around torch optimizers, elementwise (AdamW) or not (Muon, Adafactor).

This module builds the parts of one step and runs it, calling down into them (none calls back up); which part does
what: docs/design.md, "One step" (offload: :mod:`zeroimpl.offload`'s timeline).
"""

from __future__ import annotations

import contextlib
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
from .inflight import guards_lifted
from .inner import PieceMasters, build_on_every_rank, step_pieces
from .layout import ShardLayout, ShardPiece, build_layout, trainable_specs
from .memory_format import contiguous_strides, same_order
from .offload import KERNEL_KEYS, CPUOffload, OffloadOption, gradient_store, inner_kwargs, resolve_offload
from .optimizer_kinds import OUTER_ONLY_KEYS
from .ownership import ModelFollower, Ownership
from .param_sync import ParamSync
from .precision import DynamicLossScaler, LossScaleConfig
from .state_format import describe_groups, pieces_of_torch_state, place_piece, split_state, torch_optimizer_state
from .step_checks import StepChecks, nonfinite_message, passes_message
from .topology import Topology, resolve_topology

STATE_FORMAT = "zeroimpl.sharded_optimizer/2"


class _PartSettings(NamedTuple):
    """The constructor's choices that :meth:`ShardedOptimizer._build_parts` builds from (again after a move)."""

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

    Every rank holds the same parameters after ``step()``. Options in depth: docs/advanced.md.

    Args:
        params: parameters or param-group dicts; a group may name its class under ``"optimizer"``.
        optimizer_class: the class of groups that name none (not LBFGS, SparseAdam).
        stage: ``1`` shards optimizer state and masters; ``2`` also gradients.
        offload: ``"cpu"`` or a :class:`zeroimpl.CPUOffload`: the shard's state and step on the host.
        process_group: the data-parallel group (``None``: the world).
        device_mesh: a ``DeviceMesh`` instead: 1-D, its group; 2-D (dims unnamed or ``("replicate", "shard")``),
            hybrid sharding. ``rank``, ``world_size``: the shard group's.
        bucket_numel: elements per gradient/parameter bucket.
        max_inflight_buckets: reduce-scatters backward keeps in flight before waiting (0: none). Hybrid: as many
            replica all-reduces too.
        reduce_dtype: gradient reduce and shard dtype (``None``: fp32; fp64 for fp64 models). Loss
            scaling widens 16-bit shards to fp32.
        loss_scale: dynamic loss scaling: ``"auto"``, on for fp16 parameters; a :class:`LossScaleConfig`, on;
            ``None``, off. When on, call ``optimizer.backward(loss)`` (or :meth:`scale_loss`).
        nonfinite: NaN/Inf gradients without loss scaling (or at minimum scale): ``"raise"`` ``FloatingPointError``
            on every rank, or ``"skip"``. Either way nothing is updated and the gradients are cleared.
        collective_timeout: seconds before a stuck collective raises :class:`zeroimpl.CollectiveError` (CUDA: host
            waits only). ``None``: the process group's timeout.
        assume_elementwise: shard unknown classes flat (elementwise updates only).
        per_parameter: classes to shard by whole parameters (Shampoo, SOAP).
        verify_every: every this many steps, raise :class:`zeroimpl.DivergenceError` if ranks' parameters differ.
        overlap_param_gather: leave parameter all-gathers in flight after ``step()`` until first use (bitwise as
            ``False``).
        quantize_param_gather: all-gather parameter changes in 8 bits (exact masters).
        quantize_grad_reduce: reduce gradients in 8 bits, summed in fp32 (``"replicas"``: across replicas only).
        init_sync: ``"broadcast"`` rank 0's parameters, or ``"check"`` that ranks agree (else raise).
        **optimizer_kwargs: for ``optimizer_class`` (``lr``, ...).
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
                                 quantize_grad_reduce, init_sync)
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
        validation.check_params(trainable, self.topology, {**layout.fingerprint(), **quantized},
                                values=init_sync == "check")
        # a CPU model under NCCL (built through its GPU) may move there later; the step refuses it until then
        self._unplaced: Optional[str] = validation.placement_problem(trainable, self.process_group)
        members = [p for g in self.param_groups for p in g["params"]]  # frozen ones too
        optimizer_kinds.check_whole_groups(self.param_groups)
        self.ownership = Ownership(trainable, [p for p in members if not p.requires_grad])  # frozen: out of the layout
        try:
            if init_sync == "broadcast":  # once this optimizer owns them, before they move into its buffers
                module_buffers.broadcast_parameters(members, self.topology, collective_timeout)
            self._build_parts(trainable, layout, agree=True)
        except BaseException:  # (the parameters are free for the optimizer built next)
            self.ownership.release()
            raise
        self._constructed = True
        self._follower: Optional[ModelFollower] = ModelFollower(self._follow_model, self.ownership)
        self._follower.remember(self.trainable_params)

    def _lay_out(self) -> tuple[list[torch.nn.Parameter], ShardLayout]:
        settings = self._settings
        trainable, specs = trainable_specs(self.param_groups, settings.step_works, settings.blocks)
        return trainable, build_layout(specs, self.world_size, settings.bucket_numel)

    def _build_parts(self, trainable: list[torch.nn.Parameter], layout: ShardLayout, agree: bool) -> None:
        """Build every part from ``trainable``; ``agree``: check the inner optimizers' construction on every rank."""
        settings, timeout = self._settings, self.collective_timeout
        self.trainable_params: list[torch.nn.Parameter] = trainable  # indexed by layout parameter index
        self._built_strides = [p.stride() for p in trainable]  # the memory formats the buffers hold (a rebuild's check)
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
                                         self.topology if agree else None, trainable, self.pieces.runs())
        self.inner.report(self.param_groups)
        self.defaults = self.inner.defaults

        self.loss_scaler: Optional[DynamicLossScaler] = DynamicLossScaler.resolve(settings.loss_scale, trainable)
        self.uneven = uneven.UnevenInputs(self, self.join_device, self.join_process_group, timeout)
        self.reducer = GradientReducer(layout=layout, storages=self.storages, topology=self.topology, stage=self.stage,
                                       reduce_dtype=settings.reduce_dtype, max_inflight=settings.max_inflight_buckets,
                                       gradients=self.gradients, uneven=self.uneven,
                                       quantized=settings.quantize_grad_reduce, unplaced=self._unplaced)
        self.checks = StepChecks(reducer=self.reducer, ownership=self.ownership, loss_scaler=self.loss_scaler,
                                 topology=self.topology, device=self._device)
        self.grad_views = GradViews(params=trainable, pieces=self.pieces.pieces, checks=self.checks)
        self.reducer.call_after_backward(self.grad_views.expose)

    def _follow_model(self, before_collectives: bool = False) -> None:
        """Before the first gradient or step, rebuild the parts around the parameters the model now holds (after
        ``model.to()``, ``.half()``, ``load_state_dict(assign=True)``), carrying loaded state over (collective) or
        raising if it no longer fits. ``before_collectives``: raise on every rank if collectives cannot reach them."""
        if self._follower is not None:
            with torch.inference_mode(False):  # (a first forward under inference mode: the parts stay trainable)
                self._rebuild_after_a_move()
        if before_collectives and self._unplaced is not None:
            raise ValueError(self._unplaced)

    def _rebuild_after_a_move(self) -> None:
        successors = self.ownership.successors
        if not successors and not any(storage.rebound_params() for storage in self.storages):
            return
        if self.reducer.backward_passes or self.gradients.has_gradients or self._steps_taken:
            return  # (gradients of the old parameters: the step's check names the change)
        self.param_sync.finish_param_sync(take_edits=self._loaded)  # (weights loaded since the state: kept)
        carried = self._carried_state() if self._loaded else None
        for group in self.param_groups:
            group["params"] = [successors.get(id(p), p) for p in group["params"]]
        trainable, layout = self._lay_out()
        validation.check_local_params(trainable)
        self._unplaced = validation.placement_problem(trainable, self.process_group)
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
        pieces = self.pieces.states(self.inner)
        return (_positions(p for p, _, _ in pieces), self._built_strides,
                [state for _, _, state in pieces], [(s.master, s.shard) for s in self.storages],
                self.loss_scaler.state_dict() if self.loss_scaler else None)

    def _carry_over(self, positions: list, strides: list, states: list, masters: list,
                    loss_scaler: Optional[dict]) -> None:
        """Local: the loaded state moves to the rebuilt parts. The parameters keep the values the model holds now
        (written since the move: a model loaded after it); separate masters carry over where they were not. Refused
        where the state would no longer fit: other pieces, memory formats, or separate masters the model dropped."""
        sizes = [s.master.numel() for s in self.storages]
        dropped = any(master is not shard and not storage.has_separate_master
                      for storage, (master, shard) in zip(self.storages, masters))
        if (_positions(self.layout.pieces(self.rank)) != positions or [m.numel() for m, _ in masters] != sizes
                or [p.stride() for p in self.trainable_params] != strides or dropped):
            raise RuntimeError("the model was converted after optimizer state was loaded into the ShardedOptimizer, "
                               "and the conversion changed how the parameters are laid out in its buckets (their "
                               "dtypes or memory formats), so the loaded state no longer fits its shards: convert the "
                               "model first, then load the state (or the checkpoint)")
        self.restore_state(states, [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                           loss_scaler=loss_scaler)
        with torch.no_grad():
            for storage, (master, shard_then) in zip(self.storages, masters):
                if storage.has_separate_master:
                    written = storage.shard != shard_then.to(storage.shard.device, storage.shard.dtype)
                    storage.master.copy_(torch.where(written.to(master.device), storage.shard.to(master.device),
                                                     master))
                    storage.mark_master_in_sync()

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, stage: Literal[1, 2] = 2, **options):
        """Replace a torch ``optimizer`` (class, groups, defaults, plus ``options``; ``ValueError`` once it holds
        state); its schedulers follow, its ``step()`` raises."""
        groups, optimizer_class, defaults = optimizer_kinds.settings_of(optimizer)
        return optimizer_kinds.hand_over(optimizer, cls(groups, optimizer_class, stage, **{**defaults, **options}))

    def add_param_group(self, param_group: dict) -> None:
        """Raises ``NotImplementedError``: groups are fixed."""
        if getattr(self, "_constructed", True):
            raise NotImplementedError("ShardedOptimizer cannot add param groups after construction (the shard "
                                      "layout is fixed); pass every group to the constructor")
        super().add_param_group(param_group)

    @property
    def loss_scale(self) -> Optional[float]:
        """The loss scale; ``None`` without scaling."""
        return self.loss_scaler.scale if self.loss_scaler else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped or raised for NaN/Inf gradients: checkpointed with the loss scaler, else since
        construction."""
        return self.loss_scaler.skipped_steps if self.loss_scaler else self._skipped_without_scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (fp32), for your own backward; ``loss`` itself without scaling."""
        if self.loss_scaler is None:
            return loss
        self.checks.note_loss_scaled()
        return loss.float() * self.loss_scaler.scale

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()``, scaled if loss scaling is on."""
        self.scale_loss(loss).backward(**backward_kwargs)

    def accumulating(self) -> ContextManager[None]:
        """Wrap non-final micro-batches' backward (offload: summed on the device)."""
        return self.gradients.accumulating()

    def join_hook(self, **kwargs) -> uneven.RefuseUnevenInputs:
        """Under ``Join``, a rank that ran out of data makes every rank raise ``UnevenInputsError``."""
        return uneven.RefuseUnevenInputs(self.join_device, self.join_process_group, self.collective_timeout)

    @property
    def join_device(self) -> torch.device:  # where the Join flags live (a CPU model under NCCL: its GPU)
        return self._device if self._unplaced is None else self.topology.reaching(self._device)

    @property
    def join_process_group(self):
        """The group of every rank that steps with this optimizer (the world under hybrid sharding)."""
        whole_world = self.process_group is None or self.topology.replicate is not None
        return dist.group.WORLD if whole_world else self.process_group  # (the object DDP names too, not None)

    def _agree(self, norm_type: Optional[float] = None) -> Optional[torch.Tensor]:
        """:meth:`StepChecks.agree` unless its verdict stands and no norm is asked; unequal backward passes raise."""
        stands = norm_type is None and self.checks.verdict_stands()
        total = None if stands else self.checks.agree(norm_type)
        if not self.checks.verdict.same_passes:
            passes = self.reducer.backward_passes
            self.zero_grad()
            raise RuntimeError(passes_message(passes))
        return total

    def found_nonfinite(self) -> bool:
        """Whether ``step()`` will skip or raise for NaN/Inf. Collective."""
        self._follow_model(before_collectives=True)
        with torch.no_grad():
            if not self.grad_views.prepare():
                return False
            self._agree()
        return self.checks.verdict.nonfinite

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the averaged gradients, same norm on every rank. Collective (under
        DDP: torch's, local). NaN/Inf gradients stay unclipped; ``max_norm=inf`` only reads the norm."""
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        self._follow_model(before_collectives=True)
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

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Update from the averaged gradients, or skip (``nonfinite``). Collective."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._follow_model(before_collectives=True)
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
        """By bucket index, this rank's (master piece, gradient piece) pairs to step."""
        self.inner.follow(self.param_groups)  # hyperparameters the user (or a scheduler) changed
        grads = [None if grad is None else grad.to(storage.master.dtype)
                 for storage, grad in zip(self.storages, self.gradients.ready())]
        return self.pieces.gradient_pairs(grads, self.checks.verdict.stepped)

    def _skip_step(self) -> None:
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
        """The one reset of a round of gradients (of no parameter a gather writes: after the step, whose gathers just
        started, unguarded); the checks go last, or the next backward would look like none."""
        with guards_lifted() if consumed_by_step else contextlib.nullcontext():
            self.grad_views.discard()
            if consumed_by_step:
                verdict = self.checks.verdict
                self.reducer.end_step(stepped=None if verdict is None else verdict.stepped)
            else:
                self.reducer.zero_grad(set_to_none)
            self.checks.reset()

    def train(self) -> None:
        """Schedule-free classes: undo :meth:`eval`. Collective."""
        self._switch_mode("train")

    def eval(self) -> None:
        """Schedule-free classes: switch to the averaged parameters. Collective."""
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        self._follow_model(before_collectives=self.inner.has_mode(mode))  # (a switch all-gathers the parameters)
        self.sync_masters()
        if self.inner.switch_mode(mode, self.param_groups):
            self.param_sync.start_param_sync()

    def finish_param_gathers(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for parameter all-gathers in flight (of ``buckets``, or all). Local."""
        self.param_sync.finish_param_sync(buckets)

    def trains(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` has a parameter (frozen too) in this optimizer's groups."""
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
        """Collective: raise :class:`zeroimpl.DivergenceError` on every rank unless ranks' parameters are equal."""
        self._follow_model(before_collectives=True)
        self.finish_param_gathers()
        verify.verify_ranks_agree(self.storages, self.ownership.frozen, self.topology, self._device,
                                  self._steps_taken, lambda param: verify.param_name(self.param_groups, param))

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather the full torch-format state for the :meth:`state_dict` of rank ``to`` of the shard group
        (hybrid: of every replica), until the next step or load."""
        self.sync_masters()
        whole = [bucket.whole or bool(bucket.block) for bucket in self.layout.buckets]
        split = [(piece, *(_on_host(part) for part in split_state(state, tuple(master.shape),
                                                                  whole[piece.bucket_index], master.stride())))
                 for piece, master, state in self.piece_states()]
        gathered = self.topology.gather_objects(split, to, "state dict consolidation")
        self._consolidated = None if gathered is None else self._full_state(gathered)

    def _full_state(self, gathered: list[list[tuple]]) -> dict:
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
        """This rank's shard (inner state, group hyperparameters, separate masters, loss scaler), by reference; local.
        After :meth:`consolidate_state_dict`: the full state, on rank ``to`` (under DDP only then, else
        ``RuntimeError``)."""
        if self._consolidated is not None:  # its hyperparameters as they are now (a scheduler may have moved them)
            groups = [{**described["hyperparameters"], "params": saved["params"]}
                      for described, saved in zip(describe_groups(self), self._consolidated["param_groups"])]
            return {**self._consolidated, "param_groups": groups}
        if self.reducer.under_ddp:
            raise RuntimeError(validation.DDP_STATE_DICT_MESSAGE)
        self.sync_masters()
        separate = any(s.has_separate_master for s in self.storages)
        quantized = any(s.blocks is not None for s in self.storages)
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "layout": self.layout.fingerprint(),
            "strides": [tuple(p.stride()) for p in self.trainable_params],  # the flat order of every shard
            "inner": self.inner.state_dict(),
            "param_groups": [described["hyperparameters"] for described in describe_groups(self)],
            "master_weights": [s.master for s in self.storages] if separate else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "quantize_param_gather": quantized,
            "published_shards": [s.published for s in self.storages] if quantized else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Collective: load this rank's :meth:`state_dict` (same world size and layout), or a full torch-format state
        (any world size; model first). All ranks raise ``ValueError``, changing nothing, if one cannot."""
        self._follow_model()
        self._consolidated = None
        if (isinstance(state_dict, dict) and "format" not in state_dict
                and {"state", "param_groups"} <= state_dict.keys()):  # torch's format: a full state, no zeroimpl tag
            self._load_full(state_dict)
            return
        self._agree_to_load(self._load_problem(state_dict))
        self._install(state_dict["inner"], state_dict["param_groups"], state_dict["master_weights"],
                      state_dict["loss_scaler"])
        # the next quantized all-gather starts from the parameters as saved, else from the dequantized masters
        for storage in (s for s in self.storages if s.blocks is not None):
            saved = state_dict.get("published_shards")
            storage.published.copy_(saved[storage.bucket.index] if saved else
                                    storage.blocks.decoded(storage.blocks.encode(storage.master)))

    def _load_full(self, state_dict: dict) -> None:
        pieces = [(piece, master) for piece, master, _ in self.piece_states()]
        problem, split = None, None
        try:
            split = pieces_of_torch_state(state_dict, describe_groups(self), self.trainable_params, self.layout, pieces)
        except (ValueError, KeyError, TypeError, IndexError) as error:  # (a damaged or foreign state dict)
            problem = f"the full optimizer state cannot be loaded: {type(error).__name__}: {error}"
        self._agree_to_load(problem)
        self.restore_state(*split, loss_scaler=state_dict.get("loss_scaler"))

    def _agree_to_load(self, problem: Optional[str]) -> None:
        """Raise the same refusal on every rank unless all can load (``problem``: why this one cannot). Collective:
        a loop that saved rank 0's shard alone (nanoGPT) then raises on every rank at resume, rather than hang."""
        problems = self.topology.all_gather_objects(problem, "state dict agreement")
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

    def piece_states(self) -> list[tuple[ShardPiece, torch.Tensor, Optional[dict]]]:
        """This rank's pieces in ``layout.pieces(rank)`` order, with master views and inner state (``None``: none)."""
        self._follow_model()
        return self.pieces.states(self.inner)

    def restore_state(self, piece_states: list[Optional[dict]], hyperparameters: list[dict],
                      masters: Optional[list[torch.Tensor]] = None, loss_scaler: Optional[dict] = None,
                      published: Optional[list[torch.Tensor]] = None) -> None:
        """Install saved state: ``piece_states`` (in :meth:`piece_states` order), each group's ``hyperparameters``, a
        loss scaler's (``None``: keep it). With ``masters`` (per bucket), all-gather the parameters from them, or from
        ``published`` (a quantized all-gather's saved shards): collective; else the masters follow the parameters."""
        self._follow_model(before_collectives=masters is not None)
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
        """Install checked state, keeping the inner optimizers' own kernel choice (it decides where torch puts state
        such as ``step``). ``masters`` ``None``: saved without separate masters, which keep following the parameters."""
        self.param_sync.finish_param_sync()  # no all-gather may still write the parameters, no copy read the masters
        self._loaded = True
        self._consolidated = None
        kernels = [{k: v for k, v in g.items() if k in KERNEL_KEYS} for g in self.inner.param_groups]
        inner_state = {**inner_state, "param_groups": [{**g, **kernel} for g, kernel in
                                                       zip(inner_state["param_groups"], kernels)]}
        self.inner.load_state_dict(inner_state)  # moves the state to the masters' device and dtype
        for outer, own, saved, kernel in zip(self.param_groups, self.inner.param_groups, hyperparameters, kernels):
            # the saved outer groups are the newer: a scheduler may have changed them since the step mirrored them
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
            "bucket_buffers": self.reducer.live_buffers() + self.param_sync.gathers.live_buffers(),
        }

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by kind and place."""
        return memory_report(self.held_tensors(), offload=self.offload is not None)


def _positions(pieces) -> list[tuple[int, int, int, int]]:
    return [(p.param_index, p.param_start, p.param_end, p.bucket_index) for p in pieces]


def _on_host(part):
    if part is None:
        return None
    return {key: value.detach().cpu() if torch.is_tensor(value) else value for key, value in part.items()}
