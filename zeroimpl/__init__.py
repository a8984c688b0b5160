"""zeroimpl: ZeRO stage 1 and 2 as a drop-in torch optimizer wrapper."""

from .accounting import MemoryReport, StateBytes, estimate_memory
from .pending import CollectiveError
from .layout import ShardLayout, build_layout
from .module_buffers import BufferBroadcast, broadcast_buffers, sync_buffers, sync_module_states
from .offload import CPUOffload
from .optimizer import ShardedOptimizer
from .precision import LossScaleConfig
from .uneven import UnevenInputsError
from .verify import DivergenceError

__all__ = ["ShardedOptimizer", "CPUOffload", "CollectiveError", "DivergenceError", "BufferBroadcast", "broadcast_buffers", "sync_buffers", "sync_module_states", "LossScaleConfig", "MemoryReport", "StateBytes", "ShardLayout",
           "build_layout", "estimate_memory", "UnevenInputsError"]
__version__ = "0.1.0"
