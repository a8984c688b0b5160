"""Count every collective zeroimpl issues per optimizer step, with its size.

The claim: per step, one reduce-scatter of the gradients (Ψ elements plus bucket padding) and one
all-gather of the parameters (the same) -- on gloo by default as pairwise exchanges, in which each of the
2 ranks sends and receives half of each, else (ZEROIMPL_COLLECTIVES=native, NCCL's default) as the
backend's collectives -- and one all-reduce of 5 elements (the "gradient norm not finite" flag, the
clipping norm, two sums that tell whether every rank ran as many backward passes, and whether some rank
lacks a gradient for some parameter) -- no gradient
all-reduce. (Only a step whose norm is not finite adds a 1-element all-reduce: tests/test_step_checks_nonfinite.py.)
Stage 1 communicates once per step however many micro-batches are accumulated; stage 2 reduces every
micro-batch.
"""

import contextlib
import os
from functools import partial

import pytest
import torch

from distributed import case_results, issuing_collectives_at_one_rank, run_cases, run_distributed
from zeroimpl.integrations.collectives import CollectiveCounter, summarize
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer

@contextlib.contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` inside, what it was (or its absence) after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _count(rank, world_size, stage, accum, clip, dtype, algorithm):
    """One configuration, with ZEROIMPL_COLLECTIVES and the counter installed for it alone (set, then restored)."""
    counter = CollectiveCounter().install()
    try:
        with _environment("ZEROIMPL_COLLECTIVES", algorithm):
            return _count_steps(rank, counter, stage, accum, clip, dtype)
    finally:
        counter.uninstall()


def _count_steps(rank, counter, stage, accum, clip, dtype):
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, bucket_numel=4096, lr=1e-3)
    per_step = []
    for step in range(3):
        counter.take()
        for micro in range(accum):
            optimizer.backward(model(**batch(rank, step, micro)).loss / accum)
        if clip:
            optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(counter.take())
    layout = optimizer.layout
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"per_step": per_step, "buckets": len(layout.buckets), "padded": layout.padded_numel,
            "numel": layout.numel, "psi": psi}


CONFIGS = [
    (1, 1, False, torch.float32, "pairwise"), (2, 1, False, torch.float32, "pairwise"),
    (1, 4, False, torch.float32, "pairwise"), (2, 4, False, torch.float32, "native"),
    (2, 1, True, torch.float32, "native"), (2, 2, True, torch.float16, "pairwise"),
]


def _count_across_nodes(rank, world_size):
    """Stage 2 with the default algorithms, as if each rank were a node of its own (torchrun's GROUP_RANK, the
    node number, = the rank): the group spans nodes."""
    with _environment("GROUP_RANK", str(rank)):
        return _count(rank, world_size, 2, 1, False, torch.float32, "")


def _count_all(rank, world_size):
    cases = {config: partial(_count, rank, world_size, *config) for config in CONFIGS}
    return run_cases({**cases, "across nodes": partial(_count_across_nodes, rank, world_size)})


@pytest.fixture(scope="module")
def counts_by_config():
    """Every configuration in one launch of 2 ranks, each with its own model, optimizer and counter."""
    return run_distributed(2, _count_all)


@pytest.mark.parametrize("stage,accum,clip,dtype,algorithm", CONFIGS)
def test_collectives_per_step(counts_by_config, stage, accum, clip, dtype, algorithm):
    for result in case_results(counts_by_config, (stage, accum, clip, dtype, algorithm)):
        buckets, padded = result["buckets"], result["padded"]
        assert result["numel"] == result["psi"]  # tied and frozen parameters are not counted
        assert 0 <= padded - result["psi"] < buckets * 2 * 8  # padding < world_size * alignment per bucket
        reductions = accum if stage == 2 else 1
        for calls in result["per_step"]:
            if algorithm == "native":
                summary = summarize(calls)
                assert summary.pop("reduce_scatter_single") == (reductions * buckets, reductions * padded,
                                                                {torch.float32})
                assert summary.pop("all_gather_single") == (buckets, padded, {dtype})
            else:  # per bucket and reduction, one send and one receive of half the bucket; gradients in fp32
                summary = summarize([c for c in calls if c.name not in ("isend", "irecv")])
                expected = {}
                for name in ("isend", "irecv"):
                    for key, count, elements in (((name, torch.float32), reductions * buckets, reductions * padded // 2),
                                                 ((name, dtype), buckets, padded // 2)):
                        before = expected.get(key, (0, 0))
                        expected[key] = (before[0] + count, before[1] + elements)
                sent = {}
                for call in calls:
                    if call.name in ("isend", "irecv"):
                        before = sent.get((call.name, call.dtype), (0, 0))
                        sent[(call.name, call.dtype)] = (before[0] + 1, before[1] + call.numel)
                assert sent == expected
            count, total, _ = summary.pop("all_reduce")
            assert (count, total) == (1, 5)
            assert summary == {}, f"unexpected collectives {summary}"


def test_across_nodes_the_all_gather_is_the_backends_ring_and_the_reduce_scatter_stays_pairwise(counts_by_config):
    """comm.py: a pairwise all-gather sends a piece between every two ranks, so over a group that spans nodes
    (by torchrun's GROUP_RANK, agreed at the group's first all-gather, before the steps counted here) gloo's
    own all-gather, a ring that crosses each node boundary once, is used; the reduce-scatter stays pairwise
    (gloo's own costs more than an all-reduce there too)."""
    for result in case_results(counts_by_config, "across nodes"):
        buckets, padded = result["buckets"], result["padded"]
        for calls in result["per_step"]:
            summary = summarize(calls)
            assert summary.pop("all_gather_single") == (buckets, padded, {torch.float32})
            assert summary.pop("isend") == (buckets, padded // 2, {torch.float32})  # the reduce-scatter's half
            assert summary.pop("irecv") == (buckets, padded // 2, {torch.float32})
            assert summary.pop("all_reduce")[:2] == (1, 5) and summary == {}, summary


def _agreement(rank, world_size):
    from zeroimpl.topology import Topology

    smallest = torch.iinfo(torch.int64).min
    checksums = torch.tensor([smallest, 5, smallest, -3]) if rank == 0 else torch.tensor([5, smallest, smallest, -3])
    rates = torch.tensor([0.5, -0.0, float("inf")]) if rank == 0 else torch.tensor([0.25, 0.0, float("inf")])
    return Topology().same_on_every_rank(checksums).tolist(), Topology().same_on_every_rank(rates).tolist()


def test_agreement_tells_apart_integers_at_the_types_minimum():
    """Topology.same_on_every_rank: int64 checksums that differ only where one rank holds the type's minimum
    (whose negation wraps to itself) differ; equal ones agree; floats too (-0.0 equals 0.0, as == says)."""
    for checksums, rates in run_distributed(2, _agreement):
        assert checksums == [False, False, True, True]
        assert rates == [False, True, True]


def _object_broadcasts(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from zeroimpl.topology import Topology

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = Topology(shard=mesh.get_group("shard"), replicate=mesh.get_group("replicate"))
    value = {"rank": rank, "padding": "x" * (100 * rank)}  # pickles of different sizes
    return {name: (topology.all_gather_objects(value), [topology.broadcast_object(value, p) for p in range(4)])
            for name, topology in (("flat", Topology()), ("hybrid", hybrid))}


def test_an_object_broadcast_gives_every_rank_the_value_of_the_position_it_names():
    """Topology.broadcast_object(value, p), flat and on a 2 x 2 mesh (replicate x shard), from every position:
    every rank receives what all_gather_objects puts at position p (whose order it takes)."""
    for by_topology in run_distributed(4, _object_broadcasts):
        for gathered, broadcast in by_topology.values():
            assert broadcast == gathered
        assert [value["rank"] for value in by_topology["flat"][0]] == [0, 1, 2, 3]


def _inputs(world_size: int, numel: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input, regenerated alike on every rank: normal values scaled by 1 to 100,
    so that fp32 sums of three or more depend on their order."""
    generator = torch.Generator().manual_seed(7)
    scales = torch.pow(10.0, 2 * torch.rand(world_size, numel, generator=generator))
    return list(torch.randn(world_size, numel, generator=generator) * scales)


def _pairwise_reduce_scatter(rank, world_size):
    from zeroimpl import comm

    inputs = _inputs(world_size, 256 * world_size)
    output = torch.empty(256)
    comm.reduce_scatter(output, inputs[rank].clone(), None).wait()
    in_place = inputs[rank].clone()  # the output over the input's own piece: received beside it, not into it
    comm.reduce_scatter(in_place.view(world_size, -1)[rank], in_place, None, tag=1).wait()
    return output, in_place.view(world_size, -1)[rank]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pairwise_reduce_scatter_sums_in_its_documented_order(world_size):
    """comm.py: rank r's shard is its own piece, then the pieces of ranks r - 1, r - 2, ... (mod N), added
    left to right: bitwise, on data where another order gives other bits (from 3 ranks); the same with the
    output over the input's own piece."""
    results = run_distributed(world_size, _pairwise_reduce_scatter, env={"ZEROIMPL_COLLECTIVES": "pairwise"})
    outputs = [output for output, in_place in results]
    assert all(torch.equal(output, in_place) for output, in_place in results)
    pieces = [x.view(world_size, -1) for x in _inputs(world_size, 256 * world_size)]

    def summed(rank, sources):
        total = pieces[rank][rank].clone()
        for source in sources:
            total += pieces[source % world_size][rank]
        return total
    for rank, output in enumerate(outputs):
        documented = summed(rank, [rank - k for k in range(1, world_size)])
        other_way = summed(rank, [rank + k for k in range(1, world_size)])  # own, then r + 1, r + 2, ...
        assert torch.equal(output, documented), f"rank {rank}"
        assert world_size == 2 or not torch.equal(documented, other_way)  # the data tells the orders apart


@contextlib.contextmanager
def _reduce_scatters_into_their_input(seen: list):
    """While inside, ``seen`` gets, per ``dist.reduce_scatter_single(output, input)`` call, whether ``output``
    lies inside ``input`` (in place: NCCL's one-rank collective then moves no data)."""
    original = torch.distributed.reduce_scatter_single

    def recorded(output, input, *args, **kwargs):
        low = input.data_ptr()
        seen.append(low <= output.data_ptr() < low + input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)
    torch.distributed.reduce_scatter_single = recorded
    try:
        yield
    finally:
        torch.distributed.reduce_scatter_single = original


def _one_rank(rank, world_size):
    """Stage 2 (and stage 1 with offload) at world size 1, as built and with collectives issued at one rank:
    (the collectives issued per step, the parameters after 3 steps, whether each reduce-scatter wrote into
    its own input)."""
    results = {}
    for switch in ("", "1"):
        for stage, offload in ((2, None), (1, "cpu")):
            counter, in_place = CollectiveCounter().install(), []
            try:
                with (issuing_collectives_at_one_rank() if switch else contextlib.nullcontext(),
                      _reduce_scatters_into_their_input(in_place)):
                    model = build_model("gpt2", torch.float32)
                    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, offload=offload,
                                                 bucket_numel=4096, lr=1e-3)
                    for step in range(3):
                        optimizer.backward(model(**batch(rank, step, 0)).loss)
                        optimizer.step()
                        optimizer.zero_grad()
                    optimizer.finish_param_gathers()
                    calls = summarize(counter.take())
            finally:
                counter.uninstall()
            results[(switch, stage)] = ({name: count for name, (count, _, _) in calls.items()},
                                        [p.detach().clone() for p in model.parameters()], len(optimizer.layout.buckets),
                                        in_place)
    return results


def test_a_test_switch_issues_the_real_collectives_at_world_size_1():
    """Collectives issued at one rank: the backend's reduce-scatter and all-gather run at world size 1 (the
    GPU kit's path on a one-GPU machine), once per bucket per step, each reduce-scatter into an output of its
    own (in place, NCCL's one-rank collective moves nothing: a missing wait before reading a shard would go
    unseen), and train bitwise as the copies do; without it, none runs."""
    (results,) = run_distributed(1, _one_rank)
    for stage in (2, 1):
        (plain, plain_params, buckets, _), (switched, switched_params, _, in_place) = (results[("", stage)],
                                                                                     results[("1", stage)])
        assert in_place == [False] * 3 * buckets
        assert "reduce_scatter_single" not in plain and "all_gather_single" not in plain, plain
        # one per bucket per step (construction's object all-gather has nothing to gather at one rank)
        assert switched["reduce_scatter_single"] == 3 * buckets and switched["all_gather_single"] == 3 * buckets, \
            switched
        assert all(map(torch.equal, plain_params, switched_params))


LATE_PEER_TIMEOUT = 0.5


def _late_peer(rank, world_size):
    """Rank 1 joins each of two all-reduces 1.5 s late; rank 0 waits for each on the host with a 0.5 s timeout:
    the first as a CPU collective is waited for, the second polled as a CUDA one is (beyond the reduce-scatter
    window, and the step's check all-reduce before its result is read: gloo's all-reduce reports completion as
    NCCL's does). Each must raise CollectiveError naming the collective once the timeout has passed, not before it
    (gloo's wait takes whole milliseconds: a bound rounded down raises early) and not after 1.5 s. The time is
    the wait's own, from its call to its error."""
    import time

    import torch.distributed as dist

    from zeroimpl.comm import CollectiveError, all_reduce, all_reduce_

    tensor = torch.ones(4)
    raised = []
    for on_stream in (False, True):
        if rank == 1:
            time.sleep(1.5)
            all_reduce_(tensor, dist.ReduceOp.SUM, None, None, "late all-reduce")
            continue
        launched = time.monotonic()
        pending = all_reduce(tensor, dist.ReduceOp.SUM, None, LATE_PEER_TIMEOUT, "late all-reduce")
        pending.on_stream = on_stream
        started = time.monotonic()
        try:
            pending.wait_on_host()
            raised.append(None)
        except CollectiveError as error:
            raised.append((time.monotonic() - started, str(error)))
        time.sleep(1.6 - (time.monotonic() - launched))  # the late rank completes this all-reduce first
    return raised


def test_a_host_wait_for_a_collective_is_bounded_by_its_timeout():
    for raised in run_distributed(2, _late_peer)[0]:  # waited as a CPU collective, then polled as a CUDA one
        assert raised is not None, "the host wait did not raise"
        seconds, message = raised
        assert LATE_PEER_TIMEOUT <= seconds < 1.4, raised
        assert "late all-reduce" in message and f"timeout of {LATE_PEER_TIMEOUT} s" in message, raised


# -- in process --------------------------------------------------------------------------------------------------
def test_node_count_counts_distinct_node_numbers_and_any_unknown_as_one_node():
    """comm.node_count: the ranks' node numbers (torchrun's GROUP_RANK + 1), 0 where a rank's is unknown."""
    from zeroimpl.comm import node_count

    assert node_count([1, 1, 2, 2]) == 2 and node_count([1, 1, 1]) == 1 and node_count([3, 1, 2]) == 3
    assert node_count([1, 2, 1, 2, 2, 2]) == 2  # nodes with 2 and 4 ranks
    assert node_count([1, 0, 2]) == 1 and node_count([0, 0]) == 1
