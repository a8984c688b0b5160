"""The collectives zeroimpl issues, in one place so that they can be read, counted and replaced.

Reduce-scatter, all-gather and the 8-bit all-to-all run ``native`` (the backend's own; always off the CPU) or
``pairwise`` (N - 1 point-to-point exchanges, step k sending to rank ``r + k`` and receiving from ``r - k``, all posted
at once); both send ``(N - 1) / N`` of the tensor per rank, the ring minimum. Gloo runs pairwise, the faster
(``benchmarks/results/collectives-gloo.md``), but for an all-gather over a group that :func:`spans_nodes`: pairwise
sends ``1 / N`` between *every* two ranks, where gloo's ring (ranks numbered node by node) crosses each node boundary
once; the reduce-scatter stays pairwise, gloo's costing more than an all-reduce (``benchmarks/results/network/``).
``ZEROIMPL_COLLECTIVES=native|pairwise`` forces the choice on the CPU (read per collective: set it alike on all ranks).

At world size 1 an in-place reduce-scatter issues nothing, any other collective the backend's one-rank copy; an
optimizer issues none (:func:`issues_collectives`). ``torch.distributed`` functions are looked up at call time, so
that tests can wrap them. Every wait goes through :class:`zeroimpl.pending.Pending`: bounded by ``timeout``, failing
for good once it raised, handing the CPU tensors lent to gloo's worker threads (:func:`_aliases`) to
:mod:`zeroimpl.shutdown`.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .pending import HOST_POLL_SECONDS, CollectiveError, Pending
from .quantized_comm import ShardBlocks

ALGORITHMS = ("native", "pairwise")


def issues_collectives(world_size: int) -> bool:
    """Whether an optimizer over ``world_size`` ranks issues the backend's collectives (and the 8-bit all-gather's
    encoding). Looked up here at build time, so that tests can patch it to run that path on one GPU."""
    return world_size > 1


def _collective(new_name: str, old_name: str):
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def algorithm(group, tensor: torch.Tensor, gather: bool = False, timeout: Optional[float] = None) -> str:
    """``native`` or ``pairwise`` for ``tensor``'s reduce-scatter (``gather``: all-gather): native off the CPU, else
    ``ZEROIMPL_COLLECTIVES`` (ValueError if unknown), else pairwise on gloo unless an all-gather spans nodes."""
    if tensor.device.type != "cpu":
        return "native"
    chosen = os.environ.get("ZEROIMPL_COLLECTIVES", "")
    if chosen:
        if chosen not in ALGORITHMS:
            raise ValueError(f"ZEROIMPL_COLLECTIVES={chosen!r} is not one of {ALGORITHMS}; unset it for the default")
        return chosen
    return "native" if dist.get_backend(group) != "gloo" or (gather and spans_nodes(group, timeout)) else "pairwise"


_spans: dict[tuple, bool] = {}  # (the group's global ranks, this rank's GROUP_RANK) -> spans_nodes' answer


def spans_nodes(group, timeout: Optional[float] = None) -> bool:
    """Whether ``group``'s ranks sit on more than one node, by torchrun's ``GROUP_RANK`` (False if a rank lacks it).
    Collective (one all-reduce, so that all agree) the first time a group asks and when ``GROUP_RANK`` changes."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    node = os.environ.get("GROUP_RANK", "")
    key = (ranks, node)
    if key not in _spans:
        nodes = torch.zeros(len(ranks), dtype=torch.float64)
        nodes[dist.get_rank(group)] = int(node) + 1 if node.isdigit() else 0  # 0: unknown
        all_reduce_(nodes, dist.ReduceOp.SUM, group, timeout, "node agreement")
        _spans[key] = node_count(nodes.tolist()) > 1
    return _spans[key]


def node_count(node_numbers) -> int:
    """How many nodes the ranks with these node numbers (1, 2, ...; 0: unknown) sit on; any unknown: 1."""
    return 1 if 0 in node_numbers else len(set(node_numbers))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, timeout: Optional[float] = None,
                   tag: int = 0) -> Pending:
    """Start ``output = sum over ranks of input[rank * n:(rank + 1) * n]``; ``n = output.numel()``. ``input``
    must stay untouched until the wait; ``tag`` (one per bucket) tells apart pairwise ones in flight at once.
    Pairwise, the sum runs in a fixed order (own piece, then ``r - 1``, ``r - 2``, ...: at N = 2 bitwise the
    native sum) and holds a receive buffer of ``(N - 2) / N`` of ``input`` until the wait."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    name, on_stream = "gradient reduce-scatter", input.device.type != "cpu"
    if world == 1 and output.data_ptr() == input.data_ptr():  # in place at one rank: nothing to sum
        return Pending([], name, timeout)
    if world == 1 or algorithm(group, input) == "native":
        launch = _collective("reduce_scatter_single", "reduce_scatter_tensor")
        lent = _aliases(output, input)
        return Pending([launch(*lent, op=dist.ReduceOp.SUM, group=group, async_op=True)], name, timeout, lent=lent,
                       on_stream=on_stream)
    pieces = input.view(world, -1)
    # r - 1's piece lands in ``output`` if it can: a fresh buffer's page faults cost more on the CPU than the sum
    direct = output.dtype == input.dtype and output.is_contiguous() and not _overlap(output, input)
    received = torch.empty(world - 1 - direct, output.numel(), dtype=input.dtype, device=input.device)
    works = _exchange([pieces[(rank + k) % world] for k in range(1, world)],
                      [output, *received] if direct else list(received), group, 2 * tag)

    def add_pieces():
        if direct:
            output.add_(pieces[rank])
        else:
            torch.add(pieces[rank], received[0], out=output)
        for piece in received[0 if direct else 1:]:
            output.add_(piece)
    return Pending(works, name, timeout, finish=add_pieces, buffers=(received,), on_stream=on_stream)


def reduce_scatter_quantized(output: torch.Tensor, input: torch.Tensor, blocks: ShardBlocks, group,
                             timeout: Optional[float] = None, tag: int = 0) -> Pending:
    """Start ``output`` = this rank's piece of ``input`` (exact) plus every other rank's, sent to its owner as an
    8-bit payload on the owner's ``blocks`` (:mod:`zeroimpl.quantized_comm`) and summed there in fp32: an
    all-to-all of about a quarter of :func:`reduce_scatter`'s fp32 bytes. Shapes and ``tag`` as there."""
    works, lent, sent, received = _send_payloads(input, blocks, group, tag)
    return Pending(works, "gradient reduce-scatter (8-bit)", timeout,
                   finish=lambda: _summed(input, received, blocks, group, output), buffers=(sent, received),
                   lent=lent, on_stream=input.device.type != "cpu")


def all_reduce_quantized(tensor: torch.Tensor, blocks: ShardBlocks, group, timeout: Optional[float] = None,
                         tag: int = 0) -> Pending:
    """Start ``tensor`` = its sum over the group, 8 bits both ways: a :func:`reduce_scatter_quantized` of its
    ``blocks.shard_numel``-element pieces (zero-padded), then at the wait an all-gather of each owner's fp32 sum as
    a payload, decoded by every rank, the owner too, so that all hold the same values. ``tensor`` must stay
    untouched until the wait, which works in it when it needs no padding."""
    world, rank, n, size = dist.get_world_size(group), dist.get_rank(group), blocks.shard_numel, blocks.payload_bytes
    name = "gradient shard all-reduce across replicas (8-bit)"
    if world == 1:  # the sum is the tensor
        return Pending([], name, timeout)
    if tensor.numel() == world * n and tensor.dtype == torch.float32 and tensor.is_contiguous():
        padded = tensor  # in place: no copy in, none out
    else:
        padded = torch.empty(world * n, dtype=torch.float32, device=tensor.device)
        padded[:tensor.numel()].copy_(tensor)
        padded[tensor.numel():].zero_()
    works, lent, sent, received = _send_payloads(padded, blocks, group, tag)

    def gather_sums():
        payloads = torch.empty(world * size, dtype=torch.uint8, device=tensor.device)
        mine = padded.view(world, n)[rank]
        _summed(padded, received, blocks, group, out=mine)  # (the pieces sent are encoded: padded is free)
        own = blocks.encode(mine, out=payloads[rank * size:(rank + 1) * size])
        all_gather(payloads, own, group, timeout, tag, name).wait()
        for r, values in enumerate(padded.view(world, n)):
            blocks.decoded(payloads[r * size:(r + 1) * size], r, out=values)
        if padded is not tensor:
            tensor.copy_(padded[:tensor.numel()])
    return Pending(works, name, timeout, finish=gather_sums, buffers=(padded, sent, received), lent=lent,
                   on_stream=tensor.device.type != "cpu")


def _send_payloads(input: torch.Tensor, blocks: ShardBlocks, group, tag: int) -> tuple:
    """Post the all-to-all sending each other rank its piece of ``input``, encoded on its blocks; return the works,
    the aliases lent, and the payloads sent and received (``(world_size, payload_bytes)`` uint8, row r: rank r)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = input.view(world, -1)
    sent = torch.empty(world, blocks.payload_bytes, dtype=torch.uint8, device=input.device)
    sent[rank].zero_()  # (sent to itself by a native all-to-all, never read)
    for owner in range(world):
        if owner != rank:
            blocks.encode(pieces[owner], owner, out=sent[owner])
    received = torch.empty_like(sent)
    if algorithm(group, input) == "native":
        lent = _aliases(received, sent)
        return [dist.all_to_all_single(*lent, group=group, async_op=True)], lent, sent, received
    works = _exchange([sent[(rank + k) % world] for k in range(1, world)],
                      [received[(rank - k) % world] for k in range(1, world)], group, 2 * tag)
    return works, (), sent, received


def _summed(input: torch.Tensor, received: torch.Tensor, blocks: ShardBlocks, group, out: torch.Tensor) -> None:
    """``out`` = this rank's piece of ``input`` plus every other rank's decoded payload in ``received``, summed in
    fp32 in rank order (in ``out`` itself when it is fp32, which may be that piece; else then cast to its dtype)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    own = input.view(world, -1)[rank]
    if out.dtype != torch.float32:
        total = own.to(torch.float32, copy=True)
    else:
        total = out if out.data_ptr() == own.data_ptr() else out.copy_(own)
    for sender in range(world):
        if sender != rank:
            blocks.accumulate(received[sender], total)
    if total is not out:
        out.copy_(total)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, timeout: Optional[float] = None,
               tag: int = 0, name: str = "parameter all-gather",
               then: Optional[Callable[[], None]] = None) -> Pending:
    """Start ``output[rank * n:(rank + 1) * n] = input`` of every rank; ``input`` may be that slice of ``output``.
    ``then``: run once the gather has landed, as the wait's last act."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    on_stream = output.device.type != "cpu"
    if world == 1 or algorithm(group, output, gather=True, timeout=timeout) == "native":
        launch = _collective("all_gather_single", "all_gather_into_tensor")
        lent = _aliases(output, input)
        return Pending([launch(*lent, group=group, async_op=True)], name, timeout, finish=then, lent=lent,
                       on_stream=on_stream, reports_completion=True)
    pieces = output.view(world, -1)
    if input.data_ptr() != pieces[rank].data_ptr():
        pieces[rank].copy_(input)
    works = _exchange([pieces[rank]] * (world - 1), [pieces[(rank - k) % world] for k in range(1, world)],
                      group, 2 * tag + 1)
    return Pending(works, name, timeout, finish=then, on_stream=on_stream)


def wait_for_stream(stream, timeout: Optional[float], name: str) -> None:
    """Block the host until a CUDA ``stream`` has run what is queued on it now, bounded by ``timeout`` (then
    :class:`CollectiveError`): what it runs may wait for a hung collective (offload's copies of reduced
    gradients), which ``stream.synchronize()`` would wait out for as long as NCCL's watchdog lets it."""
    event = stream.record_event()
    if timeout is None:
        event.synchronize()
        return
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise CollectiveError(f"ShardedOptimizer's {name} did not finish within collective_timeout={timeout} s: "
                                  "the collective they wait for probably hangs (another rank died or hangs); "
                                  "restart the job from the last checkpoint (zeroimpl.checkpoint.load_checkpoint)")
        time.sleep(HOST_POLL_SECONDS)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group, timeout: Optional[float] = None,
               name: str = "all-reduce") -> Pending:
    """Start reducing ``tensor`` in place across the group; it must stay untouched until the wait."""
    lent = _aliases(tensor)
    return Pending([dist.all_reduce(*lent, op=op, group=group, async_op=True)], name, timeout, lent=lent,
                   on_stream=tensor.device.type != "cpu")


def broadcast(tensor: torch.Tensor, group, timeout: Optional[float] = None, name: str = "broadcast",
              source: int = 0) -> Pending:
    """Start overwriting ``tensor`` on every rank of the group with that of group rank ``source``."""
    lent = _aliases(tensor)
    return Pending([dist.broadcast(*lent, src=_peer(group, source), group=group, async_op=True)], name, timeout,
                   lent=lent, on_stream=tensor.device.type != "cpu", reports_completion=True)


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group, timeout: Optional[float] = None,
                name: str = "all-reduce", read_on_host: bool = False) -> None:
    """Reduce ``tensor`` in place across the group. ``read_on_host``: the host waits for it, bounded by ``timeout``
    (the caller reads it next); else, on an accelerator, the current stream waits."""
    pending = all_reduce(tensor, op, group, timeout, name)
    (pending.wait_on_host if read_on_host else pending.wait)()


def all_gather_objects(value, group, timeout: Optional[float] = None, name: str = "object all-gather",
                       device: Optional[torch.device] = None) -> list:
    """Every rank's picklable ``value``, in group-rank order, each wait bounded by ``timeout`` (unlike
    ``dist.all_gather_object``): the pickled sizes, then the pickles padded to the largest. On NCCL they travel on
    ``device``, the parameters' GPU: without ``torch.cuda.set_device``, NCCL would see GPU 0 once per rank."""
    world = dist.get_world_size(group)
    if world == 1:  # nothing to gather (a copy, as one through the bytes would be)
        return [pickle.loads(pickle.dumps(value))]
    mine, sizes = _pickled_with_sizes(value, group, timeout, name, device)
    longest = int(sizes.max())
    gathered = torch.zeros(world * longest, dtype=torch.uint8, device=mine.device)
    padded = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
    all_gather(gathered, padded, group, timeout, name=name).wait_on_host()
    rows = gathered.view(world, longest).cpu()
    return [pickle.loads(rows[r, :int(sizes[r])].numpy().tobytes()) for r in range(world)]


def broadcast_object(value, source: int, group, timeout: Optional[float] = None, name: str = "object broadcast",
                     device: Optional[torch.device] = None):
    """Group rank ``source``'s ``value`` on every rank of the group, bounded and placed as in
    :func:`all_gather_objects`: two broadcasts, the pickle's size, then the pickle (no padded row per rank)."""
    if dist.get_world_size(group) == 1:
        return pickle.loads(pickle.dumps(value))
    device = collective_device(group, device)
    mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    broadcast(size, group, timeout, name, source).wait_on_host()
    received = mine if dist.get_rank(group) == source else torch.empty(int(size), dtype=torch.uint8, device=device)
    broadcast(received, group, timeout, name, source).wait_on_host()
    return pickle.loads(received.cpu().numpy().tobytes())


def gather_objects(value, to: int, group, timeout: Optional[float] = None, name: str = "object gather",
                   device: Optional[torch.device] = None) -> Optional[list]:
    """Every rank's ``value`` on group rank ``to``, in group-rank order (``None`` on the others), bounded and placed
    as in :func:`all_gather_objects`: an all-gather of the pickled sizes, then each pickle sent to ``to`` alone."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return [pickle.loads(pickle.dumps(value))]
    mine, sizes = _pickled_with_sizes(value, group, timeout, name, device)
    if rank != to:
        lent = _aliases(mine)
        Pending([dist.isend(*lent, _peer(group, to), group=group)], name, timeout, lent=lent).wait_on_host()
        return None
    others = [r for r in range(world) if r != rank]
    lent = _aliases(*(torch.empty(int(sizes[r]), dtype=torch.uint8, device=mine.device) for r in others))
    Pending([dist.irecv(tensor, _peer(group, r), group=group) for tensor, r in zip(lent, others)], name, timeout,
            lent=lent).wait_on_host()
    received = dict(zip(others, lent))
    return [pickle.loads((mine if r == rank else received[r]).cpu().numpy().tobytes()) for r in range(world)]


def _pickled_with_sizes(value, group, timeout: Optional[float], name: str,
                        device: Optional[torch.device]) -> tuple[torch.Tensor, torch.Tensor]:
    device = collective_device(group, device)
    mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    sizes = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group, timeout,
               name=name).wait_on_host()
    return mine, sizes


def collective_device(group, device: Optional[torch.device]) -> torch.device:
    """Where ``group``'s collectives reach a tensor (a pickle, a CPU model's parameters under NCCL): on NCCL
    ``device`` if it is a GPU, else the group's bound GPU, else the current one -- or, where that is GPU 0 and
    torchrun's ``LOCAL_RANK`` says otherwise (a script that never calls ``set_device``), the GPU NCCL itself would
    guess for this rank; on other backends the host."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None:
        return bound
    current, local_rank = torch.cuda.current_device(), os.environ.get("LOCAL_RANK", "")
    if current == 0 and local_rank.isdigit():
        return torch.device("cuda", int(local_rank) % torch.cuda.device_count())
    return torch.device("cuda", current)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def _aliases(*tensors: torch.Tensor) -> tuple:
    """Fresh aliases (same memory, new Python objects) of ``tensors`` for a collective that a gloo worker thread
    runs: after :meth:`Pending.wait` only the work holds them (:mod:`zeroimpl.shutdown`)."""
    return tuple(tensor.detach() for tensor in tensors)


def _exchange(sends: list, receives: list, group, tag: int) -> list:
    """Post steps k = 1..N-1 of a pairwise exchange: ``sends[k - 1]`` to rank r + k, ``receives[k - 1]`` from r - k."""
    rank, works = dist.get_rank(group), []
    for k, (send, receive) in enumerate(zip(sends, receives), start=1):
        works.append(dist.isend(send, _peer(group, rank + k), group=group, tag=tag))
        works.append(dist.irecv(receive, _peer(group, rank - k), group=group, tag=tag))
    return works


def _peer(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` (mod the group's size): what isend/irecv address."""
    group_rank %= dist.get_world_size(group)
    return group_rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, group_rank)

