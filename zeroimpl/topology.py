"""Which ranks a ShardedOptimizer spans, and the collectives that reach all of them. Flat (a process group, or a 1-D
DeviceMesh): the *shard group* is the whole group, each rank owning one shard. Hybrid (a 2-D DeviceMesh, replicate ×
shard, as FSDP2's HSDP names its dims): the shard group is one mesh row (typically one node), which owns the shards and
runs the reduce-scatter and all-gather; the *replicate group* is one column, whose ranks all-reduce their gradient shard
after each reduce-scatter and so hold bit-identical shards, state and parameters. Collectives over every rank (the
step's checks, the checkpoint's agreements) run in the shard group, then the replicate group."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from . import comm

SHARD_DIM_NAMES = ("shard", "dp_shard")
REPLICATE_DIM_NAMES = ("replicate", "dp_replicate")


@dataclass(frozen=True)
class Topology:
    """One optimizer's process groups, and where and how long (``timeout``) their collectives run."""

    shard: Optional[dist.ProcessGroup] = None  # the ranks that own the shards (None: the default group)
    replicate: Optional[dist.ProcessGroup] = None  # the ranks that hold this rank's shard too (None: no replicas)
    device: Optional[torch.device] = None  # where object gathers travel on NCCL (None: the current GPU)
    timeout: Optional[float] = None  # collective_timeout, bounding its steps' collectives (None: the group's)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate is None else dist.get_rank(self.replicate)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def replica(self) -> Optional[tuple[int, int]]:
        return None if self.replicate is None else (self.replicate_rank, self.replicate_size)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def is_first(self) -> bool:
        """Rank 0 of the shard group in replica 0: the one rank that writes what is written once."""
        return self.shard_rank == 0 and self.replicate_rank == 0

    def reaching(self, device: Optional[torch.device]) -> torch.device:
        return comm.collective_device(self.shard, device)

    def groups(self) -> list:
        return [self.shard] + ([self.replicate] if self.replicate is not None else [])

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp, name: str = "all-reduce",
                    read_on_host: bool = False) -> torch.Tensor:
        for group in self.groups():
            comm.all_reduce_(tensor, op, group, self.timeout, name, read_on_host)
        return tensor

    def same_on_every_rank(self, values: torch.Tensor, name: str = "agreement all-reduce") -> torch.Tensor:
        """Elementwise, whether every rank holds the same 1-D ``values`` (the maximum is the minimum); the same
        answer on every rank. Integers take the minimum as ``~max(~x)``, since ``-x`` wraps at the type's minimum
        (``[min, 5]`` would read as agreeing)."""
        mirror = torch.neg if values.is_floating_point() else torch.bitwise_not  # order-reversing, exact
        high, mirrored_low = self.all_reduce_(torch.cat([values, mirror(values)]), dist.ReduceOp.MAX, name,
                                              read_on_host=True).chunk(2)
        return high == mirror(mirrored_low)

    def all_gather_objects(self, value, name: str = "object all-gather") -> list:
        """Every rank's ``value``: entry ``r * shard_size + s`` is shard rank ``s`` of replica ``r``."""
        row = comm.all_gather_objects(value, self.shard, self.timeout, name, self.device)
        if self.replicate is None:
            return row
        return [item for rows in comm.all_gather_objects(row, self.replicate, self.timeout, name, self.device)
                for item in rows]

    def broadcast_object(self, value, source: int, name: str = "object broadcast"):
        """On every rank, the ``value`` of rank ``source`` in :meth:`all_gather_objects`' order: broadcast in every
        shard group from shard rank ``source % shard_size``, then in every replicate group from that replica."""
        replica, shard_rank = divmod(source, self.shard_size)
        value = comm.broadcast_object(value, shard_rank, self.shard, self.timeout, name, self.device)
        if self.replicate is None:
            return value
        return comm.broadcast_object(value, replica, self.replicate, self.timeout, name, self.device)

    def gather_objects(self, value, to: int, name: str = "object gather") -> Optional[list]:
        """Every shard rank's ``value``, in shard-rank order, on shard rank ``to`` of each replica; else ``None``."""
        return comm.gather_objects(value, to, self.shard, self.timeout, name, self.device)


def resolve_topology(process_group: Optional[dist.ProcessGroup], device_mesh, groups: list[dict],
                     timeout: Optional[float]) -> Topology:
    """ShardedOptimizer's topology; its device is the first trainable parameter's in ``groups``."""
    device = next((p.device for group in groups for p in group["params"] if p.requires_grad), None)
    return replace(_groups_of(process_group, device_mesh), device=device, timeout=timeout)


def _groups_of(process_group: Optional[dist.ProcessGroup], device_mesh) -> Topology:
    if device_mesh is None:
        return Topology(process_group)
    if process_group is not None:
        raise ValueError("pass either process_group or device_mesh to ShardedOptimizer, not both")
    if not hasattr(device_mesh, "get_group") or device_mesh.ndim not in (1, 2):
        raise ValueError(f"device_mesh must be a 1-D or 2-D torch.distributed.DeviceMesh (replicate x shard), got "
                         f"{device_mesh!r}")
    if device_mesh.ndim == 1:
        return Topology(device_mesh.get_group())
    names = tuple(device_mesh.mesh_dim_names or ())
    if names and not (names[0] in REPLICATE_DIM_NAMES and names[1] in SHARD_DIM_NAMES):
        raise ValueError(f"a 2-D device_mesh must have its dims named (replicate, shard), as FSDP2's HSDP does: "
                         f"init_device_mesh(device, (replicas, shard_size), mesh_dim_names=('replicate', 'shard')); "
                         f"got {names}")
    ranks = device_mesh.mesh
    # groups number their ranks in ascending global order; checked on the mesh itself, so alike on every rank
    if not (bool((ranks.diff(dim=0) > 0).all()) and bool((ranks.diff(dim=1) > 0).all())):
        raise ValueError(f"the device_mesh's ranks must increase along both dims (as init_device_mesh lays them out), "
                         f"so that each column's ranks hold the same shard; got {ranks.tolist()}")
    return Topology(device_mesh.get_group(1), device_mesh.get_group(0))
