"""Sharded checkpoints of a ShardedOptimizer: save per rank, load on any world size, convert to torch formats.

See :mod:`.files` (directory layout, crash safety, safe loading), :mod:`.reshard` (the arithmetic),
zeroimpl.state_format (an optimizer's state split into what reshards, torchao's quantized state as plain tensors),
:mod:`.api` (save / load) and :mod:`.convert` (torch formats, offline export).
"""

from ..state_format import CheckpointError
from .api import exists_on_every_rank, load_checkpoint, save_checkpoint
from .convert import consolidated_optimizer_state_dict, export_fp32_state_dict, load_torch_optimizer_state

__all__ = ["save_checkpoint", "load_checkpoint", "exists_on_every_rank", "export_fp32_state_dict", "consolidated_optimizer_state_dict",
           "load_torch_optimizer_state", "CheckpointError"]
