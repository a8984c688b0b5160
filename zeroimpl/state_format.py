"""An inner optimizer's state of one piece (or parameter), split into what reshards and joined back
(:func:`split_state`). torchao's ``OptimState8bit``, ``OptimState4bit`` and ``OptimStateFp8`` are first split into plain
parts, so that they reshard and export as bitsandbytes' 8-bit state does (:func:`plain_parts`, :func:`joined`). A value
``key`` over ``n`` elements with blocks of ``b`` is held as

* ``key/codes``: one uint8 per element, of the value's shape (4-bit codes unpacked, fp8 codes reinterpreted);
* ``key/scale``: ``n / b`` fp32 scales, one per block;
* ``key/qmap``: the quantization map (8-bit and 4-bit only), the same in every piece;
* ``key/tensor``: the recipe ``(class name, signed, dtype)``; rebuilding imports the class from torchao.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .memory_format import contiguous_strides, flattened, same_order, shaped


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this optimizer: corrupt, incomplete or from another model."""


CLASSES = {"OptimState8bit": "torchao.optim.subclass_8bit", "OptimState4bit": "torchao.optim.subclass_4bit",
           "OptimStateFp8": "torchao.optim.subclass_fp8"}
RECIPE = "tensor"


def is_recipe(key: str, value) -> bool:
    """Whether ``key: value`` is the recipe of a stored subclass value (not a user's key that merely ends so)."""
    return key.endswith("/" + RECIPE) and isinstance(value, tuple) and len(value) == 3 and value[0] in CLASSES


def plain_parts(state: Optional[dict]) -> Optional[dict]:
    """``state`` with each torchao subclass value split into its plain parts; another tensor subclass is refused."""
    if not state:
        return state
    plain = {}
    for key, value in state.items():
        if not (torch.is_tensor(value) and hasattr(type(value), "__tensor_flatten__")):
            plain[key] = value
            continue
        name = type(value).__name__
        if CLASSES.get(name) != type(value).__module__:
            raise CheckpointError(f"optimizer state {key!r} is a {name} (a tensor subclass), which zeroimpl's sharded "
                                  "checkpoints cannot reshard: they store torchao's OptimState8bit, OptimState4bit and "
                                  "OptimStateFp8 and bitsandbytes' 8-bit state. Save optimizer.state_dict() on every "
                                  "rank with torch.save and load it at the same world size and layout")
        codes = value.codes
        if name == "OptimState4bit":  # two codes per byte, the first element's in the high nibble
            codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1)
        plain[f"{key}/codes"] = codes.view(torch.uint8).reshape(value.shape)
        plain[f"{key}/scale"] = value.scale
        if hasattr(value, "qmap"):
            plain[f"{key}/qmap"] = value.qmap
        plain[f"{key}/{RECIPE}"] = (name, getattr(value, "signed", None), str(value.dtype))
    return plain


def require_logical_order(state: Optional[dict], shape: tuple, strides: tuple, index: int) -> None:
    """Refuse to move parameter ``index``'s subclass state between flat shards (blocks in memory order) and the plain
    class or whole-parameter stepping (blocks in logical order) when the two orders differ."""
    subclass_state = any(is_recipe(key, value) for key, value in (state or {}).items())
    if subclass_state and not same_order(tuple(shape), tuple(strides), contiguous_strides(tuple(shape))):
        raise CheckpointError(f"trainable parameter {index} {tuple(shape)} has strides {tuple(strides)}: zeroimpl's "
                              "flat shards quantize its torchao state in blocks of its memory order and the plain "
                              "torchao class (as whole-parameter stepping, per_parameter) in blocks of its logical "
                              "order, so the state cannot move between them; resume through "
                              "zeroimpl.checkpoint.load_checkpoint into flat shards as saved (exact at any world "
                              "size), or make the parameter contiguous before building the optimizer")


def joined(state: Optional[dict], shape: tuple) -> Optional[dict]:
    """The reverse of :func:`plain_parts` for a value of ``shape`` (the piece's, or the parameter's)."""
    if not state:
        return state
    stored = [key[:-len(RECIPE) - 1] for key, value in state.items() if is_recipe(key, value)]
    whole = {key: value for key, value in state.items() if not any(key.startswith(f"{base}/") for base in stored)}
    for key in stored:
        name, signed, dtype = state[f"{key}/{RECIPE}"]
        try:
            cls = getattr(importlib.import_module(CLASSES[name]), name)
        except ImportError as error:
            raise CheckpointError(f"optimizer state {key!r} is torchao's {name}: install torchao to load it "
                                  f"({error})") from error
        missing = [part for part in ("codes", "scale") + (("qmap",) if name != "OptimStateFp8" else ())
                   if f"{key}/{part}" not in state]
        if missing:
            raise CheckpointError(f"optimizer state {key!r} ({name}) lacks its {', '.join(missing)}: the checkpoint is "
                                  "damaged")
        codes, scale, dtype = state[f"{key}/codes"].contiguous(), state[f"{key}/scale"], getattr(torch, dtype[6:])
        if name == "OptimState4bit":
            flat = codes.reshape(-1)
            whole[key] = cls((flat[::2] << 4) | flat[1::2], scale, state[f"{key}/qmap"], signed, torch.Size(shape),
                             dtype=dtype)
        elif name == "OptimStateFp8":
            whole[key] = cls(codes.view(torch.float8_e4m3fn).reshape(shape), scale, dtype=dtype)
        else:
            whole[key] = cls(codes.reshape(shape), scale, state[f"{key}/qmap"], signed, dtype=dtype)
    return whole


def split_state(state: Optional[dict], shape: tuple, whole: bool, strides: Optional[tuple] = None):
    """A piece's state -> (per-element tensors of ``shape``, flattened in ``strides``' memory order; scalars;
    piece-level tensors, only where ``whole``), or Nones for no state yet; anything else: :class:`CheckpointError`."""
    if not state:
        return None, None, None
    elementwise, scalars, whole_state = {}, {}, {}
    for key, value in plain_parts(state).items():
        if torch.is_tensor(value) and whole and (  # block scales and qmaps: piece-level whatever their shape (a
                is_per_block(key) or key.startswith("qmap") or key.endswith("/qmap")):  # 256-element piece's map)
            whole_state[key] = value.detach().cpu().clone()
        elif torch.is_tensor(value) and value.dim() >= 1 and tuple(value.shape) == tuple(shape):
            elementwise[key] = value.reshape(-1) if strides is None else flattened(value, strides)
        elif torch.is_tensor(value) and value.dim() == 0:
            scalars[key] = value.detach().cpu().clone()
        elif value is None or isinstance(value, (bool, int, float)) or is_recipe(key, value):
            scalars[key] = value
        elif torch.is_tensor(value) and whole:
            whole_state[key] = value.detach().cpu().clone()
        else:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise CheckpointError(f"optimizer state {key!r} ({shape}) is neither one value per element nor a "
                                  "scalar, so it cannot be resharded; this optimizer is not elementwise (shard it "
                                  "by whole parameters: ShardedOptimizer(..., per_parameter=[its class]))")
    return elementwise, scalars, whole_state


def is_per_block(key: str) -> bool:
    """Whether low-bit state ``key`` holds a value per block (``absmax1``/``absmax2``, ``.../scale``)."""
    return key.startswith("absmax") or key.endswith("/scale")


def block_range(start: int, end: int, block: int) -> tuple[int, int]:
    """The blocks ``[first, last)`` that elements ``[start, end)`` of a parameter span (``start`` on a block)."""
    if start % block:
        raise CheckpointError(f"element {start} is not on a quantization block of {block}: the layouts disagree")
    return start // block, -(-end // block)


def describe_groups(optimizer) -> list[dict]:
    """Each param group of a ShardedOptimizer: its hyperparameters and members (trainable index, -1: frozen)."""
    index_of = {id(p): i for i, p in enumerate(optimizer.trainable_params)}
    return [{"hyperparameters": {k: v for k, v in group.items() if k not in ("params", "optimizer")},
             "members": [index_of.get(id(p), -1) for p in group["params"]]} for group in optimizer.param_groups]


def place_piece(state: dict, numel: int, piece, per_element: dict, piece_level: dict, block: int,
                dtypes: Optional[dict] = None) -> None:
    """Write a piece's :func:`split_state` into its parameter's ``state`` (key -> flat ``numel`` tensor in memory order,
    in ``dtypes[key]`` if given): per-element values and block scales (``block``: 0 for none) at the piece's place."""
    target = slice(piece.param_start, piece.param_end)
    for key, values in per_element.items():
        dtype = (dtypes or {}).get(key, values.dtype)
        state.setdefault(key, torch.empty(numel, dtype=dtype))[target] = values
    for key, value in piece_level.items():
        if block and is_per_block(key):
            first, last = block_range(piece.param_start, piece.param_end, block)
            state.setdefault(key, torch.empty(-(-numel // block), dtype=value.dtype))[first:last] = value
        else:
            state[key] = value


def torch_optimizer_state(groups: list[dict], shapes: list[tuple], strides: list[tuple], states: list[dict],
                          scalars: list[Optional[dict]]) -> dict:
    """The plain optimizer's ``state_dict()`` over ``groups`` (:func:`describe_groups`) from each trainable parameter's
    :func:`place_piece` state, ``scalars`` (``None``: never stepped), shape and memory order."""
    state, param_groups = {}, []
    for group in groups:
        first = sum(len(g["params"]) for g in param_groups)
        param_groups.append({**group["hyperparameters"], "params": list(range(first, first + len(group["members"])))})
        for number, member in enumerate(group["members"], first):
            if member >= 0 and scalars[member] is not None:
                shape, order = tuple(shapes[member]), tuple(strides[member])
                numel = torch.Size(shape).numel()
                parts = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars[member].items()},
                         **{key: shaped(value, shape, order) if value.numel() == numel else value
                            for key, value in states[member].items()}}
                require_logical_order(parts, shape, order, member)
                state[number] = joined(parts, shape)
    return {"state": state, "param_groups": param_groups}


def pieces_of_torch_state(state_dict: dict, groups: list[dict], params: list[torch.Tensor], layout,
                          pieces: list[tuple]) -> tuple[list[Optional[dict]], list[dict]]:
    """The reverse of :func:`torch_optimizer_state` for this rank's ``pieces`` (``None``: never stepped), and the saved
    groups. Local, but every rank checks the whole dict, so all raise the same :class:`CheckpointError`."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if saved_groups is None or [len(g["params"]) for g in saved_groups] != [len(g["members"]) for g in groups]:
        raise CheckpointError("the state dict's param groups do not match this optimizer's (same groups, same "
                              "parameters, in the same order, are needed)")
    number_of = {member: number for group, saved in zip(groups, saved_groups)  # trainable index -> torch's number
                 for member, number in zip(group["members"], saved["params"]) if member >= 0}
    saved_state = state_dict["state"]
    # which keys are per element: told by a parameter that is not a scalar (for a 0-dim parameter, Adam's
    # `step` and `exp_avg` have the same shape)
    per_element = {k for i, number in number_of.items() if params[i].dim() > 0
                   for k, v in (saved_state.get(number) or {}).items()
                   if torch.is_tensor(v) and v.shape == params[i].shape}

    def split(index: int):
        param, saved = params[index], plain_parts(saved_state.get(number_of[index]))
        require_logical_order(saved, param.shape, param.stride(), index)
        flat = {k: (flattened(v, param.stride()) if torch.is_tensor(v) and v.shape == param.shape
                    and (param.dim() > 0 or k in per_element) else v) for k, v in (saved or {}).items()}
        return split_state(flat, (param.numel(),), whole=True)

    buckets = layout.buckets
    for index, slot in enumerate(layout.slots):  # every parameter, whichever rank owns it
        whole = split(index)[2]
        if whole and not buckets[slot.bucket_index].whole and not buckets[slot.bucket_index].block:
            raise CheckpointError(f"the state of parameter {number_of[index]} holds whole-parameter tensors "
                                  f"({', '.join(whole)}), but this optimizer shards it flat; shard its group by "
                                  "whole parameters (per_parameter=[its class])")
    piece_states = []
    for piece, master in pieces:
        elementwise, scalars, whole = split(piece.param_index)
        if elementwise is None:
            piece_states.append(None)
            continue
        window, block = slice(piece.param_start, piece.param_end), buckets[piece.bucket_index].block
        if block:  # a low-bit piece: the scales of its blocks, and the quantization map
            first, last = block_range(piece.param_start, piece.param_end, block)
            whole = {key: value[first:last].clone() if is_per_block(key) else value for key, value in whole.items()}
        elementwise = {key: shaped(values[window].clone(), master.shape, master.stride())
                       for key, values in elementwise.items()}
        piece_states.append(joined({**scalars, **whole, **elementwise}, tuple(master.shape)))
    return piece_states, saved_groups
