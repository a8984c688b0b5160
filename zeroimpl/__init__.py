"""zeroimpl: ZeRO stage 1 and 2 as a drop-in torch optimizer wrapper."""

# torch.distributed.nn.functional takes ``group.WORLD`` as a default argument when it is first imported, and
# torch imports it lazily (through torch._dynamo, when the first torch optimizer is built). Imported after
# init_process_group, it keeps the default process group alive past destroy_process_group(), so gloo's
# threads outlive it into interpreter finalization, where one freeing the last collective's tensors needs the
# GIL and aborts the process ("terminate called without an active exception"). Importing it here, before the
# user's init_process_group, lets destroy_process_group() join those threads (tests/test_faults.py checks).
import torch.distributed as _dist  # noqa: E402  isort: skip

if _dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401

from .accounting import MemoryReport, StateBytes
from .buffers_sync import broadcast_buffers, sync_buffers
from .comm import CollectiveError, DivergenceError
from .estimate import estimate_memory
from .layout import ShardLayout, build_layout
from .offload import CPUOffload
from .optimizer import ShardedOptimizer
from .precision import LossScaleConfig

__all__ = ["ShardedOptimizer", "CPUOffload", "CollectiveError", "DivergenceError", "broadcast_buffers", "sync_buffers", "LossScaleConfig", "MemoryReport", "StateBytes", "ShardLayout",
           "build_layout", "estimate_memory"]
__version__ = "0.1.0"
