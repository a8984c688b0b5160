"""Sharded checkpoints of a ShardedOptimizer: save per rank, load on any world size, convert to torch formats.

See :mod:`.files` (directory layout, crash safety, safe loading), :mod:`.reshard` (the arithmetic),
:mod:`.subclass_state` (torchao's quantized state as plain tensors),
:mod:`.api` (save / load) and :mod:`.convert` (torch formats, offline export).
"""

from .api import exists_on_every_rank, load_checkpoint, save_checkpoint
from .convert import consolidated_optimizer_state_dict, export_fp32_state_dict, load_torch_optimizer_state
from .files import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "exists_on_every_rank", "export_fp32_state_dict", "consolidated_optimizer_state_dict",
           "load_torch_optimizer_state", "CheckpointError"]
