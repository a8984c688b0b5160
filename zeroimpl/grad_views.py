"""``param.grad`` after backward: the averaged gradient, held as this rank's shard, readable by torch's utilities.

After a backward that reached a :class:`~zeroimpl.ShardedOptimizer` (unless under DDP), each trainable ``param.grad`` is
a :class:`ShardedGrad`: the parameter's shape, dtype and device, the *averaged* gradient DDP would leave, sharded
(this rank holds one contiguous piece, or none). So a training loop reads gradients as under DDP, at stage 2's memory:

* ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``, ``clip_grads_with_norm_`` (any ``norm_type``, foreach or
  not): the first norm computes every parameter's norm with **one all-reduce** of one value per parameter, reused
  until a gradient changes; a step's first (order > 0) carries the step's checks (``StepChecks.agree``), so that
  after torch's clipping the step issues none.
* ``clip_grad_value_`` and in-place scaling (``mul_``, ``div_``, ``clamp_``, ``zero_``, their ``_foreach`` forms):
  applied to the local piece.
* ``torch.amp.GradScaler.unscale_``: ``found_inf`` is agreed across the ranks (one all-reduce).

Any other operation raises, naming the alternatives. The first operation after a backward finishes the reduction
through :meth:`GradViews.prepare`, a collective: every rank must run the same operations, or the first fails after
the collective timeout. A view the user removed from ``.grad`` (``p.grad = None``) is *dropped*: its gradient is
forgotten, as torch forgets a cleared ``.grad``.
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import comm
from .grad_shards import DeviceGradientShards, HostGradientShards
from .grad_sync import remove_hooks
from .host_memory import to_device
from .layout import ShardPiece
from .step_checks import StepChecks

aten = torch.ops.aten

# in-place elementwise operations on one gradient, applied to its piece as they are
_ELEMENTWISE = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar, aten.clamp_.default,
                aten.clamp_.Tensor, aten.clamp_min_.default, aten.clamp_min_.Tensor, aten.clamp_max_.default,
                aten.clamp_max_.Tensor, aten.zero_.default, aten.nan_to_num_.default}
# their foreach forms over a list of gradients, with one scalar or 0-dim tensor for all: the per-tensor op
_FOREACH = {aten._foreach_mul_.Scalar: aten.mul_.Scalar, aten._foreach_mul_.Tensor: aten.mul_.Tensor,
            aten._foreach_div_.Scalar: aten.div_.Scalar, aten._foreach_div_.Tensor: aten.div_.Tensor,
            aten._foreach_clamp_min_.Scalar: aten.clamp_min_.default,
            aten._foreach_clamp_max_.Scalar: aten.clamp_max_.default, aten._foreach_zero_.default: aten.zero_.default}
_ALIASES = {aten.detach.default, aten.alias.default}
# multiplications by one factor (torch's clipping): the step's verdict stands across factors of magnitude <= 1
_MULTIPLICATIONS = {aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Scalar, aten._foreach_mul_.Tensor}
# collective: the norms, and GradScaler's unscale-and-check
_NORMS_AND_UNSCALE = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar,
                      aten._amp_foreach_non_finite_check_and_unscale_.default}


class ShardedGrad(torch.Tensor):
    """The averaged gradient of one parameter, sharded across the ranks. Shape, strides, dtype and device are the
    parameter's; the values live in this rank's piece of the gradient shard (the reduce dtype; with offload, the
    master's dtype on the host), read and written through the :class:`GradViews` that made it."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, index: int, views: "GradViews"):
        view = torch.Tensor._make_wrapper_subclass(cls, param.shape, strides=param.stride(), dtype=param.dtype,
                                                   device=param.device, requires_grad=False)
        view.param_index = index
        view.views_ref = weakref.ref(views)
        return view

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return (f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: the averaged "
                "gradient, sharded across ranks by ShardedOptimizer)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owners = {id(view.views_ref()): view.views_ref() for view in _sharded_args(args)}
        if len(owners) != 1 or None in owners.values():
            raise RuntimeError(f"{func}: the sharded gradients of two ShardedOptimizers (or of one deleted) cannot "
                               "be used in one operation; call it once per optimizer's parameters")
        return next(iter(owners.values())).run(func, args, kwargs)


def _sharded_args(args) -> list[ShardedGrad]:
    return [item for value in args for item in (value if isinstance(value, (list, tuple)) else (value,))
            if isinstance(item, ShardedGrad)]


class GradViews:
    """The ``ShardedGrad`` of each of ``params`` (by parameter index), and when they sit in ``param.grad``. ``pieces``:
    this rank's, at most one per parameter; ``checks`` finishes the reduction and unscaling and forgets dropped
    views' gradients; norms and ``found_inf`` are all-reduced in the shard group."""

    def __init__(self, *, params: list[torch.nn.Parameter], pieces: list[ShardPiece], checks: StepChecks):
        self.params = params
        self._piece = {piece.param_index: piece for piece in pieces}
        self.checks = checks
        self.gradients: Union[DeviceGradientShards, HostGradientShards] = checks.gradients
        self.group, self.timeout = checks.topology.shard, checks.topology.timeout
        self._views = [ShardedGrad(p, i, self) for i, p in enumerate(params)]  # persistent: a user may hold them
        self._installed: set[int] = set()  # parameter indices whose .grad is its view
        self._local: dict[int, torch.Tensor] = {}  # stage 1, not prepared: the rank's own gradient, by index
        self._norms: dict = {}  # ord -> each parameter's norm; reset on events every rank sees (all-reduce alike)
        self._copies: dict = {}  # (id, version, device) of an argument -> (it, its copy there): offload's clip factor
        handles = [p.register_hook(_withdraw_before_accumulating(weakref.ref(self))) for p in params]
        self.remove_hooks = weakref.finalize(self, remove_hooks, handles)  # (callable: the optimizer rebuilt)

    def prepare(self) -> bool:
        """Collective: finish the reduction and unscaling, then expose the views; False: no gradients to step on."""
        self.withdraw()  # .grad as the reducer left it (stage 1: the local gradients)
        if not self.checks.prepare():
            return False
        self.expose(prepared=True)
        return True

    def expose(self, prepared: bool = False) -> None:
        """Put every trainable parameter's view in ``.grad`` (stage 1 before ``prepare``: keeping the local gradient it
        replaces); idempotent: called at every backward's end, nested ones too. ``prepared``: the shards hold the
        averaged gradients."""
        if self.checks.reducer.under_ddp:  # (stage 1 under DistributedDataParallel, which averages param.grad)
            self.remove_hooks()  # DDP's param.grad is the averaged gradient: no view replaces it, none is withdrawn
            return
        for index, (param, view) in enumerate(zip(self.params, self._views)):
            if not param.requires_grad or param.grad is view:
                continue
            if param.grad is not None:
                if prepared:
                    continue  # stage 1: a gradient set by hand after the reduction, reduced at the step
                self._local[index] = param.grad
            param.grad = view
            self._installed.add(index)
        self.changed()

    def withdraw(self) -> None:
        """Take the views out of ``.grad`` (giving back stage 1's local gradients) before a backward accumulates and
        in :meth:`prepare`; forget the gradients of views the user had removed."""
        dropped = self.discard()
        if dropped:
            self.checks.forget(dropped)

    def discard(self) -> list[int]:
        """Take the views out of ``.grad``, forgetting nothing (the step or ``zero_grad`` consumed them); return the
        indices of views the user had removed."""
        dropped = []
        for index in sorted(self._installed):
            param = self.params[index]
            if param.grad is self._views[index]:
                param.grad = self._local.get(index)
            else:
                dropped.append(index)
        self._installed.clear()
        self._local.clear()
        self._copies.clear()
        self.changed()
        return dropped

    def changed(self) -> None:
        """The gradients changed (call on every rank alike): norms are computed afresh."""
        self._norms = {}

    def _written(self, factor=None) -> None:
        self.changed()
        self.checks.note_edit(factor)

    def full_gradients(self) -> list[torch.Tensor]:
        """The full-size gradients this rank holds (plain ``.grad``, stage 1's kept local ones): memory accounting."""
        plain = [p.grad for p in self.params if p.grad is not None and not isinstance(p.grad, ShardedGrad)]
        return plain + list(self._local.values())

    def run(self, func, args, kwargs):
        """Carry out ``func`` (an aten operation with some of this optimizer's views among its arguments)."""
        if func in _ALIASES:
            return args[0]
        if any(view.param_index not in self._installed for view in _sharded_args(args)):
            raise RuntimeError("this gradient view is no longer param.grad: step() or zero_grad() consumed the "
                               "gradients, or they were cleared. Read param.grad again after the next backward")
        problem = _unsupported_arguments(func, args, kwargs)
        if problem is not None:  # before prepare(), a collective: a debugging read on one rank raises at once
            raise RuntimeError(problem)
        if func not in _NORMS_AND_UNSCALE and func not in _ELEMENTWISE and func not in _FOREACH:  # no collective yet
            raise RuntimeError(
                f"{func} is not supported on param.grad under ShardedOptimizer: the averaged gradient is sharded "
                "across the ranks (no rank holds all of it). Supported: torch.nn.utils.clip_grad_norm_, "
                "get_total_norm, clip_grads_with_norm_ and clip_grad_value_, torch.amp.GradScaler, norms "
                "(torch.linalg.vector_norm, .norm()) and in-place scaling (mul_, div_, clamp_, zero_). For a copy "
                "of the full gradient use a DDP reference run; to edit gradients before they are averaged, use "
                "stage=1 and set param.grad by hand, or a hook (param.register_hook)")
        if not self.checks.prepared:
            with torch.no_grad():
                self.prepare()  # collective: every rank runs the same operations
        if func is aten.linalg_vector_norm.default:
            return self._norm(args[0], *args[1:], **kwargs)
        if func is aten._foreach_norm.Scalar:
            ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            return [self._norm(g, ord, dtype=dtype) if isinstance(g, ShardedGrad)
                    else torch.linalg.vector_norm(g, ord, dtype=dtype) for g in args[0]]
        if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
            return self._unscale(*args, **kwargs)
        # every other supported operation writes the gradients
        self._written(args[1] if func in _MULTIPLICATIONS and len(args) == 2 and not kwargs else None)
        if func in _ELEMENTWISE:
            self._apply(func, args[0], args[1:], kwargs)
            return args[0]
        for grad in args[0]:  # a foreach operation
            if isinstance(grad, ShardedGrad):
                self._apply(_FOREACH[func], grad, args[1:], kwargs)
            else:
                _FOREACH[func](grad, *args[1:], **kwargs)
        return None

    def _piece_tensor(self, index: int) -> Optional[torch.Tensor]:
        """This rank's elements of parameter ``index``'s averaged gradient (1-D, in the shard), or None."""
        piece = self._piece.get(index)
        if piece is None:
            return None
        shard = self.gradients.ready()[piece.bucket_index]
        return None if shard is None else shard[piece.shard_offset:piece.shard_offset + piece.length]

    def _apply(self, func, view: ShardedGrad, rest: tuple, kwargs: dict) -> None:
        piece = self._piece_tensor(view.param_index)
        if piece is not None:
            func(piece, *[self._on(value, piece.device) for value in rest],
                 **{key: self._on(value, piece.device) for key, value in kwargs.items()})

    def _on(self, value, device: torch.device):
        """``value`` where the piece is: a tensor argument on another device is copied once per version, not once
        per parameter (a copy from the GPU to the host blocks the host)."""
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        if value.is_inference():  # (no version counter to tell a changed one by)
            return value.to(device)
        key = (id(value), value._version, device)
        if key not in self._copies:
            self._copies[key] = (value, value.to(device))  # holding the original keeps its id unique
        return self._copies[key][1]

    def _norm(self, view: ShardedGrad, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
        """The ``ord``-norm of ``view``'s averaged gradient; every parameter's is cached until the gradients change.
        Partial terms in fp64: within an ulp or two of the full gradient's norm."""
        ord = float(ord)
        if ord not in self._norms:
            self._norms[ord] = self._reduce_norms(ord)
        return self._norms[ord][view.param_index].to(device=view.device, dtype=dtype or view.dtype)

    def _reduce_norms(self, ord: float) -> torch.Tensor:
        op, empty = {float("inf"): (dist.ReduceOp.MAX, 0.0), -float("inf"): (dist.ReduceOp.MIN, float("inf"))}.get(
            ord, (dist.ReduceOp.SUM, 0.0))
        terms = []
        for index in range(len(self.params)):
            piece = self._piece_tensor(index)
            if piece is None or piece.numel() == 0:
                terms.append(None)
            elif op is not dist.ReduceOp.SUM:
                terms.append(torch.linalg.vector_norm(piece, ord, dtype=torch.float64).reshape(()))
            elif ord == 0:
                terms.append(torch.count_nonzero(piece).to(torch.float64))
            else:
                terms.append(torch.linalg.vector_norm(piece, ord, dtype=torch.float64) ** ord)
        device = next((t.device for t in terms if t is not None), self.params[0].device)
        values = torch.stack([t if t is not None else torch.full((), empty, dtype=torch.float64, device=device)
                              for t in terms])  # (torch.full: torch.tensor(x, device="cuda") blocks the host)
        values = to_device(values, _comm_device(self.params[0].device, device))  # (from the host: no sync)
        if self.checks.verdict is None and (op is dist.ReduceOp.MAX or ord > 0):  # the step's checks ride along
            self.checks.agree(ord if op is dist.ReduceOp.MAX else None, riders=values)
        else:
            comm.all_reduce_(values, op, self.group, self.timeout, "gradient norm all-reduce")
        return values if op is not dist.ReduceOp.SUM or ord == 0 else values ** (1.0 / ord)

    def _unscale(self, grads, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """GradScaler's unscale: plain tensors as torch does, sharded ones in their pieces; ``found_inf`` agreed."""
        plain = [g for g in grads if not isinstance(g, ShardedGrad)]
        if plain:
            torch._amp_foreach_non_finite_check_and_unscale_(plain, found_inf, inv_scale)
        pieces = [p for p in (self._piece_tensor(g.param_index) for g in grads if isinstance(g, ShardedGrad))
                  if p is not None and p.numel()]
        local = torch.zeros(1, dtype=torch.float32, device=found_inf.device)
        by_device: dict = {}
        for piece in pieces:
            by_device.setdefault((piece.device, piece.dtype), []).append(piece)
        for (device, _), same in by_device.items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale.to(device))
            local = torch.maximum(local, to_device(found, local.device))
        self._written()
        agreed = local.to(_comm_device(found_inf.device, local.device))
        comm.all_reduce_(agreed, dist.ReduceOp.MAX, self.group, self.timeout, "GradScaler found_inf all-reduce")
        found_inf.copy_(torch.maximum(found_inf, agreed.to(found_inf.device).reshape(found_inf.shape)))


def _unsupported_arguments(func, args: tuple, kwargs: dict) -> Optional[str]:
    """Why a supported operation cannot take these arguments, or None; asked before ``prepare`` (no collective)."""
    if func is aten.linalg_vector_norm.default and (len(args) > 2 and args[2] is not None
                                                     or kwargs.get("dim") is not None):
        return ("a norm over some dimensions of a sharded param.grad is not supported (no rank holds whole rows); "
                "take the norm of the whole gradient")
    if func in _ELEMENTWISE or func in _FOREACH:
        operands = [*args[1:], *kwargs.values()]
        if any(isinstance(value, torch.Tensor) and value.numel() > 1 for value in operands):
            return (f"{func} on param.grad under ShardedOptimizer takes a number or a one-element tensor (the same "
                    "factor or bound for every element), not a tensor of other values per element: each rank holds "
                    "only its shard of the averaged gradient. Scale by a number, or edit gradients before they are "
                    "averaged (stage=1 and param.grad set by hand, or param.register_hook)")
    return None


def _comm_device(param_device: torch.device, device: torch.device) -> torch.device:
    """Where a small all-reduce runs: the parameters' device (NCCL needs CUDA tensors), else where the values are."""
    return param_device if param_device.type != "cpu" else device


def _withdraw_before_accumulating(views_ref):
    """A tensor pre-hook: withdraw the views, so that autograd accumulates into the ``.grad`` torch would."""
    def hook(grad):
        views = views_ref()
        if views is not None and views._installed:
            views.withdraw()
        return None
    return hook
