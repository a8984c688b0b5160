"""Bad input gets a clear error that names the problem and the fix, on every rank."""

import pytest
import torch

from distributed import run_distributed
from workloads import build_model
from zeroimpl import ShardedOptimizer


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def test_stage_must_be_1_or_2():
    with pytest.raises(ValueError, match="stage must be 1 .* or 2"):
        ShardedOptimizer(_linear().parameters(), torch.optim.AdamW, stage=3)


@pytest.mark.parametrize("offload", ["gpu", "CPU", True, "nvme"])
def test_offload_must_be_cpu_or_a_policy(offload):
    with pytest.raises(ValueError, match="offload must be None, 'cpu' or zeroimpl.CPUOffload"):
        ShardedOptimizer(_linear().parameters(), torch.optim.AdamW, offload=offload)


def test_non_elementwise_optimizer_is_refused():
    with pytest.raises(ValueError, match="LBFGS is not elementwise"):
        ShardedOptimizer(_linear().parameters(), torch.optim.LBFGS)


def test_unknown_optimizer_needs_assume_elementwise():
    class MyOptimizer(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="assume_elementwise=True"):
        ShardedOptimizer(_linear().parameters(), MyOptimizer, lr=0.1)


def test_process_group_must_be_initialised():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer(_linear().parameters(), torch.optim.AdamW)


def _catch(build):
    try:
        build()
    except (RuntimeError, ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _misuse(rank, world_size):
    errors = {}

    def differing_params():
        torch.manual_seed(rank)  # each rank initialises differently
        ShardedOptimizer(torch.nn.Linear(4, 4).parameters(), torch.optim.AdamW)
    errors["differing"] = _catch(differing_params)

    def sparse_gradient():
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        optimizer = ShardedOptimizer(embedding.parameters(), torch.optim.SGD, stage=2, lr=0.1)  # noqa: F841 (kept alive)
        embedding(torch.tensor([1, 2])).sum().backward()
    errors["sparse"] = _catch(sparse_gradient)

    def add_group_later():
        optimizer = ShardedOptimizer(_linear().parameters(), torch.optim.AdamW)
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    errors["add_group"] = _catch(add_group_later)

    def fp16_without_scaling():
        model = build_model("gpt2", torch.float16)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW)  # noqa: F841 (kept alive)
        ids = torch.ones(1, 4, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
    errors["fp16"] = _catch(fp16_without_scaling)

    def mixed_devices():
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))],
                         torch.optim.AdamW)
    errors["devices"] = _catch(mixed_devices)

    def wrapped_in_ddp(stage):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage)
        ddp(torch.ones(3, 4) * (rank + 1)).sum().backward()
        optimizer.step()
    errors["ddp1"] = _catch(lambda: wrapped_in_ddp(1))
    errors["ddp2"] = _catch(lambda: wrapped_in_ddp(2))

    def different_backward_counts():  # stage 1: no collective in backward, so step() can check the counts
        model = _linear()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
        for _ in range(rank + 1):
            model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    errors["backward_counts"] = _catch(different_backward_counts)

    def all_frozen():
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2), requires_grad=False)], torch.optim.AdamW)
    errors["frozen"] = _catch(all_frozen)
    return errors


def test_misuse_raises_on_every_rank(runs):
    for errors in (by_rank["misuse"] for by_rank in runs):
        assert "ranks differ in the values of the parameters" in errors["differing"]
        assert "sparse gradient" in errors["sparse"] and "sparse=False" in errors["sparse"]
        assert "cannot add param groups after construction" in errors["add_group"]
        assert "call optimizer.backward(loss)" in errors["fp16"]
        assert "several devices" in errors["devices"]
        assert "no trainable parameters" in errors["frozen"]
        assert "wrapped in DistributedDataParallel" in errors["ddp1"] and "do not wrap it in DDP" in errors["ddp2"]
        assert "different numbers of backward passes" in errors["backward_counts"]


def _lifecycle(rank, world_size):
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    out = {}
    for stage in (1, 2):
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage)
        out[f"second_owner{stage}"] = _catch(lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW))
        alive = weakref.ref(optimizer)
        del optimizer
        gc.collect()
        out[f"released{stage}"] = alive() is None  # the model's hooks do not keep it alive

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("injected failure")

    x = torch.ones(2, 4, requires_grad=True)
    out["failed"] = _catch(lambda: (model(FailingBackward.apply(x)).sum() + model.bias.sum()).backward()) or "none"
    optimizer.zero_grad()  # recovers from the half-finished backward
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

    loss = model(x).sum()  # a graph built before step(), which updates the weights in place
    loss.backward(retain_graph=True)
    optimizer.step()
    out["stale_graph"] = _catch(lambda: loss.backward())
    return out


def _both(rank, world_size):
    return {"lifecycle": _lifecycle(rank, world_size), "misuse": _misuse(rank, world_size)}


@pytest.fixture(scope="module")
def runs():
    """Both multi-rank checks in one launch of 2 ranks (each builds its own models and optimizers)."""
    return run_distributed(2, _both)


def test_lifecycle_and_recovery(runs):
    for out in (by_rank["lifecycle"] for by_rank in runs):
        assert "already managed by another ShardedOptimizer" in out["second_owner1"]
        assert "already managed by another ShardedOptimizer" in out["second_owner2"]
        assert out["released1"] and out["released2"]
        assert "injected failure" in out["failed"]  # and training went on after zero_grad()
        assert "inplace operation" in out["stale_graph"]
