"""A parameter's memory format (its strides), kept through flattening: every trainable parameter is ``numel``
consecutive elements of a flat buffer in its own memory order (a channels_last conv weight of shape (8, 8, 3, 3)
keeps its strides (72, 1, 24, 8)), so that cuDNN still picks its NHWC kernels. Its gradient slot, optimizer state
and checkpoint files use that order too (the checkpoint index records the strides). A parameter that is not dense
(overlapping elements, or gaps) is stored contiguous."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(max(size, 1) for size in shape[dim + 1:]) for dim in range(len(shape)))


def dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s strides when its elements fill ``numel`` consecutive slots in some order of its dims
    (contiguous, channels_last, a transposed matrix), else the contiguous strides of its shape."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s != 1):
        if stride != expected:
            return contiguous_strides(tensor.shape)
        expected *= size
    return tuple(tensor.stride())


def same_order(shape: Sequence[int], strides: Sequence[int], other: Sequence[int]) -> bool:
    """Whether two stride tuples of ``shape`` lay the elements out alike (dims of size 1 do not matter)."""
    return all(a == b for size, a, b in zip(shape, strides, other) if size != 1)


def shaped(flat: torch.Tensor, shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    return flat.as_strided(tuple(shape), tuple(strides))


def flattened(tensor: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """``tensor``'s elements, 1-D, in the memory order of ``strides``: a view when both are contiguous, else a copy."""
    if tensor.dim() <= 1 or tensor.is_contiguous() and (  # (equal strides: the common case, cheaply)
            tensor.stride() == strides or same_order(tensor.shape, strides, contiguous_strides(tensor.shape))):
        return tensor.reshape(-1)
    out = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    shaped(out, tensor.shape, strides).copy_(tensor)
    return out
