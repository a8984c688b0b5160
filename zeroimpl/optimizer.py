"""ShardedOptimizer: ZeRO stage 1 and 2 around any elementwise torch optimizer.

One optimizer step, as seen from one rank (Ψ trainable elements, N ranks)::

    backward  -> gradients reduce-scattered into this rank's gradient shard (Ψ/N)   [grad_sync.py]
    step      -> (fp16: unscale, agree on overflow) -> inner optimizer on the shard's master weights
              -> master written into this rank's slice of the flat parameter buffers
              -> in-place all-gather of every parameter buffer (Ψ)                   [comm.py]

The inner optimizer (e.g. torch.optim.AdamW) sees one flat 1-D tensor per bucket: the rank's master
shard. It therefore holds optimizer state for Ψ/N elements only.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist

from . import comm, validation
from .accounting import MemoryReport, tensor_bytes
from .buffers import BucketStorage, flatten_params
from .grad_sync import GradientReducer
from .layout import ParamSpec, ShardLayout, build_layout
from .precision import DynamicLossScaler, LossScaleConfig

STATE_FORMAT = "zeroimpl.sharded_optimizer/1"


class ShardedOptimizer(torch.optim.Optimizer):
    """Shards optimizer state (stage 1) and gradients (stage 2) of ``params`` across data-parallel ranks.

    Args:
        params: parameters or param-group dicts, as any torch optimizer takes. Frozen parameters
            (``requires_grad=False``) are left alone. The model must be the same on every rank and must not
            be wrapped in DistributedDataParallel: this optimizer reduces the gradients itself.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` subclass (AdamW, Adam, SGD, ...).
        stage: 1 -- shard optimizer state and master weights; gradients are reduce-scattered once per step.
            2 -- also shard gradients: they are reduce-scattered bucket by bucket during backward.
        process_group: the data-parallel group (default: the whole world).
        bucket_numel: elements per gradient/parameter bucket (default 2**22, 16 MiB of fp32). Larger
            buckets mean fewer, larger collectives; smaller ones more overlap and smaller transient buffers.
        max_inflight_buckets: reduce-scatters allowed in flight before backward waits for the oldest
            (default 2). Bounds the bucket buffers alive during backward; 0 waits for each at once.
        reduce_dtype: dtype in which gradients are reduced and the gradient shard is kept. Default: fp32
            (fp64 for fp64 parameters), for accuracy with 16-bit models.
        loss_scale: dynamic loss scaling settings, used only when parameters are fp16 (then call
            ``optimizer.backward(loss)`` instead of ``loss.backward()``).
        alignment: each bucket is padded to a multiple of ``world_size * alignment`` elements (default 8).
        assume_elementwise: accept an optimizer class zeroimpl does not know; only set it if the class
            updates every element from its own parameter, gradient and state.
        **optimizer_kwargs: passed to ``optimizer_class`` (lr, weight_decay, betas, ...).

    Invariant: every rank holds the same parameters after ``step()``; rank r's inner optimizer holds state
    for chunk r of every bucket only.
    """

    def __init__(self, params: Union[Iterable[torch.Tensor], Iterable[dict]], optimizer_class: type,
                 stage: int = 2, *, process_group: Optional[dist.ProcessGroup] = None,
                 bucket_numel: int = 2 ** 22, max_inflight_buckets: int = 2,
                 reduce_dtype: Optional[torch.dtype] = None, loss_scale: LossScaleConfig = LossScaleConfig(),
                 alignment: int = 8, assume_elementwise: bool = False, **optimizer_kwargs):
        validation.check_stage(stage)
        validation.check_optimizer_class(optimizer_class, assume_elementwise)
        validation.check_process_group(process_group)
        if max_inflight_buckets < 0:
            raise ValueError(f"max_inflight_buckets must be >= 0, got {max_inflight_buckets}")
        self._constructed = False
        super().__init__(params, dict(optimizer_kwargs))  # normalises groups, refuses duplicates

        self.stage = stage
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)

        trainable, specs = [], []
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param.requires_grad and all(param is not seen for seen in trainable):
                    trainable.append(param)
                    specs.append(ParamSpec(group_index, str(param.dtype), param.numel()))
        validation.check_params(trainable, process_group)

        self.layout: ShardLayout = build_layout(specs, self.world_size, bucket_numel, alignment)
        self.storages: list[BucketStorage] = flatten_params(self.layout, trainable, self.rank)
        self.inner: torch.optim.Optimizer = optimizer_class(self._inner_groups(), **optimizer_kwargs)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in inner.items():
                outer.setdefault(key, value)
        self.defaults = self.inner.defaults

        uses_fp16 = any(p.dtype == torch.float16 for p in trainable)
        self.loss_scaler: Optional[DynamicLossScaler] = DynamicLossScaler(loss_scale) if uses_fp16 else None
        self._in_scaled_backward = False
        self._unscaled = False  # gradient shards already divided by the loss scale this step
        self._found_overflow = False

        reduce_dtypes = [reduce_dtype or torch.promote_types(s.param_buffer.dtype, torch.float32)
                         for s in self.storages]
        self.reducer = GradientReducer(self.layout, self.storages, process_group, stage,
                                       reduce_dtypes, max_inflight_buckets, self._check_gradient_arrival)
        self._constructed = True

    def _inner_groups(self) -> list[dict]:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.param_groups]
        for storage in self.storages:
            groups[storage.bucket.group_index]["params"].append(storage.master)
        return groups

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", True):
            raise NotImplementedError("ShardedOptimizer cannot add param groups after construction (the shard "
                                      "layout is fixed); pass every group to the constructor")
        super().add_param_group(param_group)

    # -- backward ---------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> Optional[float]:
        """Current fp16 loss scale, or None when no loss scaling is used."""
        return self.loss_scaler.scale if self.loss_scaler else None

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()``, with the loss multiplied by the loss scale for fp16 models."""
        if self.loss_scaler is None:
            loss.backward(**backward_kwargs)
            return
        self._in_scaled_backward = True
        try:
            (loss.float() * self.loss_scaler.scale).backward(**backward_kwargs)
        finally:
            self._in_scaled_backward = False

    def _check_gradient_arrival(self) -> None:
        if self.loss_scaler is None:
            return
        if not self._in_scaled_backward:
            raise RuntimeError("this model has fp16 parameters, so the loss must be scaled: call "
                               "optimizer.backward(loss) instead of loss.backward()")
        if self._unscaled:
            raise RuntimeError("backward() between clip_grad_norm_() and step() is not supported with fp16 "
                               "loss scaling; run every backward of the step before clipping")

    # -- gradients --------------------------------------------------------------------------------
    def _prepare_gradients(self) -> bool:
        """Finish the reduction (and fp16 unscaling); return whether there are gradients to step on."""
        self.reducer.finalize()
        if not self.reducer.has_gradients:
            return False
        if self.loss_scaler is not None and not self._unscaled:
            shards = [s for s in self.reducer.grad_shards if s is not None]
            torch._foreach_mul_(shards, 1.0 / self.loss_scaler.scale)
            nonfinite = torch.stack([~torch.isfinite(s).all() for s in shards]).any().float().reshape(1)
            comm.all_reduce_(nonfinite, dist.ReduceOp.MAX, self.process_group)
            self._found_overflow = bool(nonfinite.item())  # the one host sync of the step
            self._unscaled = True
        return True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients of the whole model to ``max_norm``; return their total norm.

        Equal to ``torch.nn.utils.clip_grad_norm_`` over the full averaged gradients, computed from the
        shards with one all-reduce of one element. The result is identical on every rank.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        device = self.storages[0].param_buffer.device
        if not self._prepare_gradients():
            return torch.zeros((), device=device)
        shards = [s for s in self.reducer.grad_shards if s is not None]
        if norm_type == float("inf"):
            local = torch.stack([s.abs().max() for s in shards]).max().float().reshape(1)
            total = comm.all_reduce_(local, dist.ReduceOp.MAX, self.process_group)[0]
        else:
            local = torch.stack([torch.linalg.vector_norm(s, norm_type, dtype=torch.float32) ** norm_type
                                 for s in shards]).sum().reshape(1)
            total = comm.all_reduce_(local, dist.ReduceOp.SUM, self.process_group)[0] ** (1.0 / norm_type)
        if not self._found_overflow:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(shards, coefficient)
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
        if self._found_overflow:
            self.reducer.zero_grad(set_to_none=True)
            self._finish_step(overflow=True)
            return loss

        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        for storage, grad in zip(self.storages, self.reducer.grad_shards):
            storage.master.grad = None if grad is None else grad.to(storage.master.dtype)
        self.inner.step()
        for storage in self.storages:
            storage.master.grad = None
            storage.publish_master()
        self._all_gather_params()
        self._finish_step(overflow=False)
        return loss

    def _all_gather_params(self) -> None:
        works = [comm.all_gather(s.param_buffer, s.shard, self.process_group) for s in self.storages]
        for work in works:
            work.wait()
        # the all-gather wrote the parameters in place: let autograd refuse graphs built before it
        torch.autograd.graph.increment_version([p for s in self.storages for p in s.params])

    def _finish_step(self, overflow: bool) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._unscaled = False
        self._found_overflow = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grad(set_to_none)
        self._unscaled = False
        self._found_overflow = False

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state. Local only (no collective): safe to call on one rank alone.

        Tensors are references, as in ``torch.optim.Optimizer.state_dict``.
        """
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "layout": self.layout.fingerprint(),
            "inner": self.inner.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "master_weights": [s.master for s in self.storages] if self._has_separate_master else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    @property
    def _has_separate_master(self) -> bool:
        return any(s.has_separate_master for s in self.storages)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by ``state_dict()`` of the same rank, world size and parameter layout."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError("not a ShardedOptimizer state dict (missing format tag "
                             f"{STATE_FORMAT!r}); a plain torch optimizer state needs the checkpoint API")
        if state_dict["rank"] != self.rank or state_dict["layout"] != self.layout.fingerprint():
            raise ValueError(
                f"this state was saved by rank {state_dict['rank']} with world size "
                f"{state_dict['layout']['world_size']} and another parameter layout; this optimizer is rank "
                f"{self.rank} of {self.world_size}. Load each rank's own state with the same model, param "
                "groups, world size and bucket settings (resharding is the checkpoint API's job)")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("the state has a different number of param groups")
        if (state_dict["master_weights"] is None) == self._has_separate_master:
            raise ValueError("the state's master weights do not match this model's dtypes")
        if (state_dict["loss_scaler"] is None) != (self.loss_scaler is None):
            raise ValueError("the state's loss scaler does not match this model (fp16 or not)")
        self.inner.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        if state_dict["master_weights"] is not None:
            with torch.no_grad():
                for storage, master in zip(self.storages, state_dict["master_weights"]):
                    storage.master.copy_(master)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # -- introspection ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, by kind (see :class:`zeroimpl.MemoryReport`)."""
        return MemoryReport(
            parameters=tensor_bytes(s.param_buffer for s in self.storages),
            gradients=tensor_bytes(p.grad for s in self.storages for p in s.params),
            gradient_shard=tensor_bytes(self.reducer.grad_shards),
            master_weights=tensor_bytes(s.master for s in self.storages if s.has_separate_master),
            optimizer_state=tensor_bytes(v for state in self.inner.state.values() for v in state.values()),
            bucket_buffers=tensor_bytes(self.reducer.live_buffers()),
        )
