"""Sharded checkpoints of a ShardedOptimizer: save per rank, load on any world size, convert to torch formats.

See :mod:`.files` (directory layout, crash safety, safe loading), :mod:`.format` (the index, its checks, resharding),
zeroimpl.state_format (an optimizer's state split into what reshards, torchao's quantized state as plain tensors),
:mod:`.api` (save / load), :mod:`.convert` (torch formats, offline export), :mod:`.dcp` (torch.distributed.checkpoint's
format, both ways) and :mod:`.deepspeed` (a DeepSpeed ZeRO-1/2 checkpoint converted).
"""

from ..state_format import CheckpointError
from .api import exists_on_every_rank, load_checkpoint, save_checkpoint
from .convert import consolidated_optimizer_state_dict, export_fp32_state_dict, load_torch_optimizer_state
from .deepspeed import from_deepspeed

__all__ = ["save_checkpoint", "load_checkpoint", "exists_on_every_rank", "export_fp32_state_dict",
           "consolidated_optimizer_state_dict", "load_torch_optimizer_state", "DCPState", "from_deepspeed",
           "CheckpointError"]


def __getattr__(name: str):
    """``DCPState`` on first use: its module imports torch.distributed.checkpoint, which takes most of a second."""
    if name == "DCPState":
        from .dcp import DCPState
        return DCPState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
