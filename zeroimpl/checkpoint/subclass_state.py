"""Quantized optimizer state kept as tensor subclasses -- torchao's ``OptimState8bit``, ``OptimState4bit`` and
``OptimStateFp8`` -- as plain tensors, and back: what a checkpoint stores of them, so that they reshard and
export as bitsandbytes' 8-bit state does.

A state value ``key`` of one of these classes, over ``n`` elements (a piece, or a whole parameter) with
blocks of ``b``, is stored as

* ``key/codes``: one uint8 per element, of the value's shape (4-bit codes unpacked from their two per byte,
  fp8 codes reinterpreted as bytes), so that it reshards as per-element state;
* ``key/scale``: ``n / b`` fp32 scales, one per quantization block, which move with their blocks;
* ``key/qmap``: the quantization map (8-bit and 4-bit only), the same in every piece;
* ``key/tensor``: a scalar recipe ``(class name, signed, dtype)`` that rebuilds the value around them.

Rebuilding reads the class from torchao itself (only these three are accepted), so a checkpoint of torchao
state loads where torchao is installed.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ..memory_format import contiguous_strides, same_order
from .files import CheckpointError

CLASSES = {"OptimState8bit": "torchao.optim.subclass_8bit", "OptimState4bit": "torchao.optim.subclass_4bit",
           "OptimStateFp8": "torchao.optim.subclass_fp8"}
RECIPE = "tensor"


def is_part(key: str, part: str) -> bool:
    """Whether state ``key`` is the ``part`` (``"scale"``, ``"qmap"``, ...) of a stored subclass value."""
    return key.endswith("/" + part)


def is_recipe(key: str, value) -> bool:
    """Whether ``key: value`` is the recipe of a stored subclass value (not a user's key that merely ends so)."""
    return is_part(key, RECIPE) and isinstance(value, tuple) and len(value) == 3 and value[0] in CLASSES


def has_subclass_state(state: Optional[dict]) -> bool:
    """Whether a (plain-parts) state holds a stored subclass value."""
    return any(is_recipe(key, value) for key, value in (state or {}).items())


def plain_parts(state: Optional[dict]) -> Optional[dict]:
    """``state`` with every quantized subclass value replaced by its plain parts; another tensor subclass is
    refused (its layout is unknown, so it could not be resharded)."""
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
    """Refuse to move a stored subclass value of trainable parameter ``index`` between zeroimpl's flat shards and
    the plain class (or whole-parameter stepping, which is the plain class's) when the parameter is not contiguous:
    flat shards' blocks follow the parameter's memory order, the plain class's its logical order, so the scales
    would fall on other elements."""
    if has_subclass_state(state) and not same_order(tuple(shape), tuple(strides), contiguous_strides(tuple(shape))):
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
