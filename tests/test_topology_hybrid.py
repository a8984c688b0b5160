"""Hybrid sharding on a 2 x 2 DeviceMesh (replicate x shard) of 4 CPU ranks, against DDP + AdamW on 4 ranks.

Per step, each rank reduce-scatters its gradients in its shard group (2 ranks), all-reduces its reduced shard
across the replicate group, and all-gathers the parameters in its shard group: the collective counter sees
exactly RS(Ψ) + AR(Ψ/2) + AG(Ψ) plus padding, each in its group. Tolerances: the sums run in another order
than DDP's all-reduce over 4 ranks, as for flat shards at world size 4: parameters within PARAM_ATOL = 1e-4
(tests/test_optimizer_parity.py), losses within LOSS_ATOL = 1e-5. A checkpoint saved on the mesh (one copy of each
shard, by the first replica) resumes on the mesh bitwise and on a flat world of 2 within PARAM_ATOL.
"""

import os

import pytest
import torch

from distributed import run_distributed
from workloads import (RunConfig, bitwise_equal, build_model, local_batch, max_param_diff, param_groups, train,
                       train_on_global_batch)
from zeroimpl import CPUOffload, ShardedOptimizer, estimate_memory
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

PARAM_ATOL = 1e-4
LOSS_ATOL = 1e-5
CASES = {"stage 1": (1, None), "stage 2": (2, None), "stage 2 + offload": (2, "cpu")}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _parity(rank, world_size):
    mesh = _mesh()
    reference = train(RunConfig("gpt2", None, steps=4, accum=2, clip=(1.0, 2.0)))
    results = {}
    for name, (stage, offload) in CASES.items():
        zero_kwargs = {"device_mesh": mesh}
        if offload:
            zero_kwargs["offload"] = CPUOffload(fused_step=False)
        results[name] = train(RunConfig("gpt2", stage, steps=4, accum=2, clip=(1.0, 2.0), zero_kwargs=zero_kwargs))
    results["fp16"] = train(RunConfig("gpt2", 2, steps=4, accum=2, clip=(1.0, 2.0), dtype=torch.float16,
                                      zero_kwargs={"device_mesh": mesh}))
    torch.manual_seed(1337 + rank)  # every rank its own weights: the optimizer broadcasts the first rank's
    linear = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in linear.parameters()]
    ShardedOptimizer(linear.parameters(), torch.optim.AdamW, device_mesh=mesh)
    results["broadcast"] = (before, [p.detach().clone() for p in linear.parameters()])
    return reference, results


@pytest.fixture(scope="module")
def parity():
    return run_distributed(4, _parity)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_ddp_on_four_ranks(parity, case):
    for reference, results in parity:
        ours = results[case]
        assert max_param_diff(ours["params"], reference["params"]) <= PARAM_ATOL
        assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) <= LOSS_ATOL
        assert max(abs(a - b) / b for a, b in zip(ours["norms"], reference["norms"])) <= 1e-6
    first = parity[0][1][case]["params"]
    assert all(all(torch.equal(first[n], by_rank[1][case]["params"][n]) for n in first) for by_rank in parity)


def test_the_first_ranks_parameters_reach_every_rank_of_the_mesh_at_construction(parity):
    first = parity[0][1]["broadcast"][0]
    assert not torch.equal(first[0], parity[3][1]["broadcast"][0][0])  # they differed
    for reference, results in parity:
        assert all(torch.equal(a, b) for a, b in zip(results["broadcast"][1], first))


def test_fp16_with_loss_scaling_tracks_the_fp32_run(parity):
    """fp16 parameters, fp32 master shards and dynamic loss scaling on the mesh (the overflow check reaches
    every rank) track the fp32 mesh run within FP16_RTOL = 3e-2 in relative L2 (tests/test_precision_mixed.py's
    bound), and every rank ends with the same parameters."""
    for _, results in parity:
        fp16, fp32 = results["fp16"]["params"], results["stage 2"]["params"]
        difference = sum(((fp16[n] - fp32[n]) ** 2).sum() for n in fp32) ** 0.5
        assert difference / sum((fp32[n] ** 2).sum() for n in fp32) ** 0.5 <= 3e-2
    first = parity[0][1]["fp16"]["params"]
    assert all(all(torch.equal(first[n], by_rank[1]["fp16"]["params"][n]) for n in first) for by_rank in parity)


def _traffic_and_memory(rank, world_size):
    from zeroimpl.integrations.collectives import CollectiveCounter

    os.environ["ZEROIMPL_COLLECTIVES"] = "native"  # one collective per bucket, of the bucket's full size
    mesh = _mesh()
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                 device_mesh=mesh)
    counter = CollectiveCounter().install()
    try:
        for step in range(2):  # the second step is the steady state
            counter.take()
            optimizer.backward(model(**local_batch(step, rank, world_size)).loss)
            held = optimizer.memory_report()
            optimizer.step()
            optimizer.zero_grad()
        calls = counter.take()
    finally:
        counter.uninstall()
        del os.environ["ZEROIMPL_COLLECTIVES"]
    predicted = estimate_memory(param_groups(model), 2, 2, rank=optimizer.rank, bucket_numel=4096,
                                optimizer_kwargs={"lr": 1e-2})
    return {"calls": calls, "shard_ranks": tuple(torch.distributed.get_process_group_ranks(mesh.get_group(1))),
            "replicate_ranks": tuple(torch.distributed.get_process_group_ranks(mesh.get_group(0))),
            "padded": optimizer.layout.padded_numel, "shard": optimizer.layout.shard_numel,
            "psi": optimizer.layout.numel, "held": held.as_dict(), "predicted": predicted.as_dict()}


@pytest.fixture(scope="module")
def traffic():
    return run_distributed(4, _traffic_and_memory)


def test_one_step_is_a_reduce_scatter_and_an_all_gather_in_the_shard_group_and_an_all_reduce_of_the_shard(traffic):
    for result in traffic:
        by_kind = {}
        for call in result["calls"]:
            group = ("shard" if call.ranks == result["shard_ranks"] else
                     "replicate" if call.ranks == result["replicate_ranks"] else call.ranks)
            key = (call.name, group, "check" if call.numel <= 10 else "data")
            by_kind[key] = by_kind.get(key, 0) + call.numel
        assert by_kind[("reduce_scatter_single", "shard", "data")] == result["padded"]  # Ψ + padding
        assert by_kind[("all_reduce", "replicate", "data")] == result["shard"]  # Ψ/2 + padding
        assert by_kind[("all_gather_single", "shard", "data")] == result["padded"]
        assert {key for key in by_kind if key[2] == "data"} == {
            ("reduce_scatter_single", "shard", "data"), ("all_reduce", "replicate", "data"),
            ("all_gather_single", "shard", "data")}
        # the step's check all-reduce (5 elements) reaches every rank: once per group
        assert by_kind[("all_reduce", "shard", "check")] == by_kind[("all_reduce", "replicate", "check")] == 5
        assert result["padded"] - result["psi"] < 0.05 * result["psi"]


def test_memory_per_rank_is_that_of_a_shard_group_and_estimate_memory_predicts_it(traffic):
    for result in traffic:
        assert result["held"] == result["predicted"]
        assert result["held"]["device"]["optimizer_state"] < 0.55 * 8 * result["psi"]  # 8Ψ/2 + step counters


# -- checkpoints ---------------------------------------------------------------------------------------------
def _make(device_mesh=None):
    model = build_model("gpt2")
    return model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                   device_mesh=device_mesh)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _on_the_mesh(rank, world_size, root):
    """Uninterrupted 5 steps; 3 steps and a checkpoint; that checkpoint resumed on the mesh."""
    model, optimizer = _make(_mesh())
    train_on_global_batch(model, optimizer, rank, world_size, range(5))
    uninterrupted = _params(model)
    del optimizer
    model, optimizer = _make(_mesh())
    train_on_global_batch(model, optimizer, rank, world_size, range(3))
    save_checkpoint(os.path.join(root, "mesh"), optimizer, model)
    del optimizer
    model, optimizer = _make(_mesh())
    load_checkpoint(os.path.join(root, "mesh"), optimizer, model)
    train_on_global_batch(model, optimizer, rank, world_size, range(3, 5))
    return uninterrupted, _params(model)


def _on_a_flat_world(rank, world_size, root):
    model, optimizer = _make()
    load_checkpoint(os.path.join(root, "mesh"), optimizer, model)
    train_on_global_batch(model, optimizer, rank, world_size, range(3, 5))
    return _params(model)


def test_checkpoint_of_the_mesh_resumes_on_the_mesh_and_on_a_flat_world(tmp_path):
    by_rank = run_distributed(4, _on_the_mesh, str(tmp_path))
    uninterrupted, resumed = by_rank[0]
    assert all(torch.equal(uninterrupted[n], resumed[n]) for n in uninterrupted)
    assert sorted(name for name in os.listdir(tmp_path / "mesh") if name.startswith("rank-")) == [
        "rank-00000.pt", "rank-00001.pt"]  # one copy of each of the shard group's 2 shards
    flat = run_distributed(2, _on_a_flat_world, str(tmp_path))[0]
    assert max((flat[n] - uninterrupted[n]).abs().max().item() for n in uninterrupted) <= PARAM_ATOL


def _bad_meshes(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    errors = []
    for build in (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate")),
                  lambda: "not a mesh",
                  # rows {0, 3} and {2, 1}: a group numbers its ranks in global order, so rank 2 is shard 1 of
                  # its row, yet sits in column 0 beside rank 0 (shard 0): that column would mix two shards
                  lambda: DeviceMesh("cpu", torch.tensor([[0, 3], [2, 1]]), mesh_dim_names=("replicate", "shard"))):
        try:
            ShardedOptimizer(build_model("gpt2").parameters(), torch.optim.AdamW, device_mesh=build())
        except ValueError as error:
            errors.append(str(error))
    try:
        ShardedOptimizer(build_model("gpt2").parameters(), torch.optim.AdamW, device_mesh=_mesh(),
                         process_group=torch.distributed.group.WORLD)
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_bad_meshes_are_refused():
    for errors in run_distributed(4, _bad_meshes):
        assert len(errors) == 4
        assert "dims named (replicate, shard)" in errors[0]
        assert "1-D or 2-D torch.distributed.DeviceMesh" in errors[1]
        assert "must increase along both dims" in errors[2]
        assert "not both" in errors[3]


def _one_dimensional(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    return (train(RunConfig("gpt2", 2, steps=3, zero_kwargs={"device_mesh": mesh})),
            train(RunConfig("gpt2", 2, steps=3)))


def test_a_one_dimensional_mesh_is_its_group():
    for on_the_mesh, on_the_group in run_distributed(2, _one_dimensional):
        assert bitwise_equal(on_the_mesh, on_the_group)


# -- in process --------------------------------------------------------------------------------------------------
def test_the_topology_carries_the_parameters_device_for_its_object_all_gathers():
    """Catches: the checkpoint's and construction's agreements gathered on the current GPU (GPU 0 on every rank
    of a script that never calls torch.cuda.set_device) instead of the parameters' (frozen ones do not count)."""
    from zeroimpl.topology import resolve_topology

    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    trainable = torch.nn.Parameter(torch.zeros(2, device="meta"))
    groups = [{"params": [frozen]}, {"params": [trainable]}]
    assert resolve_topology(None, None, groups, None).device == torch.device("meta")
