"""Bad input gets a clear error that names the problem and the fix, on every rank."""

import pytest
import torch

from distributed import run_distributed
from zeroimpl.module_buffers import FLAT_NUMEL
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


@pytest.mark.parametrize("refused, why", [(torch.optim.LBFGS, "closure over the whole model"),
                                          (torch.optim.SparseAdam, "sparse gradients")])
def test_optimizers_that_need_more_than_one_parameter_are_refused(refused, why):
    with pytest.raises(ValueError, match=f"{refused.__name__} cannot be sharded: .*{why}"):
        ShardedOptimizer(_linear().parameters(), refused)


def test_a_group_may_not_name_a_refused_optimizer():
    linear = _linear()
    with pytest.raises(ValueError, match="LBFGS cannot be sharded"):
        ShardedOptimizer([{"params": [linear.weight], "optimizer": torch.optim.LBFGS}, {"params": [linear.bias]}],
                         torch.optim.AdamW)


def test_a_group_optimizer_must_be_an_optimizer_class():
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer subclass"):
        ShardedOptimizer([{"params": _linear().parameters(), "optimizer": "muon"}], torch.optim.AdamW)


def test_unknown_optimizer_needs_to_be_told_how_to_shard():
    class MyOptimizer(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match=r"assume_elementwise=True .*per_parameter=\[MyOptimizer\]"):
        ShardedOptimizer(_linear().parameters(), MyOptimizer, lr=0.1)


def test_keyword_arguments_that_apply_to_no_group_are_refused():
    linear = _linear()
    groups = [{"params": [linear.weight], "optimizer": torch.optim.Adam},
              {"params": [linear.bias], "optimizer": torch.optim.Adam}]
    with pytest.raises(ValueError, match=r"\['lr'\] are AdamW's, but every param group names another"):
        ShardedOptimizer(groups, torch.optim.AdamW, lr=3e-4)


@pytest.mark.parametrize("per_parameter", [torch.optim.Adam, ["Adam"]])
def test_per_parameter_must_be_a_list_of_classes(per_parameter):
    with pytest.raises(TypeError, match="per_parameter must be a list of optimizer classes"):
        ShardedOptimizer(_linear().parameters(), torch.optim.AdamW, per_parameter=per_parameter)


def test_a_single_tensor_is_not_params():
    with pytest.raises(TypeError, match="got a single tensor"):
        ShardedOptimizer(_linear().weight, torch.optim.AdamW)


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
        torch.manual_seed(rank)  # each rank initialises differently; init_sync="broadcast" (default) would mend it
        ShardedOptimizer(torch.nn.Linear(4, 4).parameters(), torch.optim.AdamW, init_sync="check")
    errors["differing"] = _catch(differing_params)

    def unknown_init_sync():
        ShardedOptimizer(_linear().parameters(), torch.optim.AdamW, init_sync="seed")
    errors["init_sync"] = _catch(unknown_init_sync)

    def differing_shapes():  # same values (zeros) and sizes: only the shapes tell the ranks apart
        shape = (2, 3) if rank == 0 else (3, 2)
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(shape))], torch.optim.AdamW)
    errors["shapes"] = _catch(differing_shapes)

    def differing_counts():  # same elements in all, split into a different number of parameters
        sizes = [4] if rank == 0 else [2, 2]
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(n)) for n in sizes], torch.optim.AdamW)
    errors["counts"] = _catch(differing_counts)

    def sparse_gradient():
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        optimizer = ShardedOptimizer(embedding.parameters(), torch.optim.SGD, stage=2, lr=0.1)  # noqa: F841 (kept alive)
        embedding(torch.tensor([1, 2])).sum().backward()
    errors["sparse"] = _catch(sparse_gradient)

    def sparse_gradient_later(stage):  # not the round's first gradient: checked as the first is
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 4))
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)  # noqa: F841
        model(torch.tensor([1, 2])).sum().backward()  # (the linear layer's gradients come first)
    errors["sparse_later_1"] = _catch(lambda: sparse_gradient_later(1))
    errors["sparse_later_2"] = _catch(lambda: sparse_gradient_later(2))

    def add_group_later():
        optimizer = ShardedOptimizer(_linear().parameters(), torch.optim.AdamW)
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    errors["add_group"] = _catch(add_group_later)

    def fp16_without_scaling():
        model = build_model("gpt2", torch.float16)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW)
        ids = torch.ones(1, 4, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()  # refused where the step prepares, before any of its collectives
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
    errors["ddp2"] = _catch(lambda: wrapped_in_ddp(2))  # (stage 1 under DDP trains: tests/test_optimizer_under_ddp.py)

    def dropped_ddp_kept_by_a_cycle():  # a wrapper the script dropped, alive until the garbage collector runs
        import gc

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        gc.disable()  # (so that no automatic collection frees it before the step looks)
        try:
            cycle = [torch.nn.parallel.DistributedDataParallel(model)]
            cycle.append(cycle)
            del cycle
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
            model(torch.ones(3, 4) * (rank + 1)).sum().backward()
            optimizer.step()
        finally:
            gc.enable()
    errors["dropped_ddp"] = _catch(dropped_ddp_kept_by_a_cycle)

    def different_backward_counts():  # stage 1: no collective in backward, so step() can check the counts
        model = _linear()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
        for _ in range(rank + 1):
            model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    errors["backward_counts"] = _catch(different_backward_counts)

    def different_backward_counts_clipped():  # the norm's all-reduce carries the check: step() still raises
        model = _linear()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
        for _ in range(rank + 1):
            model(torch.ones(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    errors["backward_counts_clipped"] = _catch(different_backward_counts_clipped)

    def built_on_meta():  # refused at once: its parameters' broadcast used to wait for a collective of no data
        with torch.device("meta"):
            model = _linear()
        ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    errors["meta"] = _catch(built_on_meta)

    def all_frozen():
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2), requires_grad=False)], torch.optim.AdamW)
    errors["frozen"] = _catch(all_frozen)

    def differing_sharding():  # the same parameters, sharded whole on one rank and flat on the other
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(4)])
        for layer in model:
            torch.nn.init.constant_(layer.weight, 0.5)
        ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                         per_parameter=[torch.optim.AdamW] if rank == 0 else [])
    errors["sharding"] = _catch(differing_sharding)

    def muon_on_a_vector_with_differing_models():  # the cross-rank check comes before Muon's own refusal
        torch.manual_seed(rank)
        linear = torch.nn.Linear(4, 4)
        ShardedOptimizer([{"params": linear.parameters(), "optimizer": torch.optim.Muon}], torch.optim.AdamW,
                         init_sync="check")
    errors["muon_differing"] = _catch(muon_on_a_vector_with_differing_models)

    def capturable_with_offload():  # in a param group: the host step cannot run torch's CUDA-graph mode
        linear = _linear()
        ShardedOptimizer([{"params": [linear.weight], "capturable": True}, {"params": [linear.bias]}],
                         torch.optim.AdamW, offload="cpu")
    errors["capturable"] = _catch(capturable_with_offload)
    return errors


MISUSE = {  # case -> what its error must say
    "differing": ["ranks differ in the values of the parameters", "init_sync at 'broadcast'",
                  "every rank then trains on the same data"],
    "init_sync": ["init_sync must be 'broadcast'", "or 'check'"],
    "shapes": ["ranks differ in the number, shapes or memory formats"],
    "counts": ["ranks differ in the number, shapes or memory formats"],
    "sparse": ["sparse gradient", "sparse=False"],
    "sparse_later_1": ["sparse gradient", "sparse=False"],
    "sparse_later_2": ["sparse gradient", "sparse=False"],
    "add_group": ["cannot add param groups after construction"],
    "fp16": ["call optimizer.backward(loss)"],
    "devices": ["several devices"],
    "frozen": ["no trainable parameters"],
    "meta": ["on the meta device", "materialize the model first", "then build ShardedOptimizer"],
    "ddp2": ["wrapped in DistributedDataParallel", "use stage=1", "drop the DDP wrap", "strategy=\"zero2\"",
             "zeroimpl.integrations.accelerate.prepare", "ZeroTrainer"],
    "backward_counts": ["different numbers of backward passes"],
    "backward_counts_clipped": ["different numbers of backward passes"],
    "sharding": ["ranks differ in the number, shapes or memory formats", "or the shard layout (param groups"],
    "muon_differing": ["ranks differ in the values of the parameters"],
    "capturable": ["capturable=True keeps the optimizer's step count on the GPU", "offload=None"],
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_raises_on_every_rank(runs, case):
    for rank, by_rank in enumerate(runs):
        message = by_rank["misuse"][case]
        assert message is not None, f"{case}: rank {rank} raised nothing"
        for expected in MISUSE[case]:
            assert expected in message, f"{case}, rank {rank}: {message}"


def test_a_dropped_ddp_wrapper_that_only_a_reference_cycle_keeps_is_not_counted(runs):
    """The DDP check finds DDP's parameter list among the live objects: one that only a reference cycle keeps
    (the script dropped the wrapper) must not make step() raise, on any rank."""
    for by_rank in runs:
        assert by_rank["misuse"]["dropped_ddp"] is None


def _checkpoint_seen_by_some_ranks(rank):
    """A checkpoint folder that rank 1 does not see (a disk of one node only), and one both see: the integrations
    refuse a missing folder only once every rank has said whether it sees it, so that all raise together."""
    import tempfile

    from zeroimpl.checkpoint import exists_on_every_rank

    optimizer = ShardedOptimizer(_linear().parameters(), torch.optim.AdamW)
    seen = tempfile.mkdtemp()
    return {"one rank sees it": exists_on_every_rank(seen if rank == 0 else seen + "-elsewhere", optimizer),
            "both see it": exists_on_every_rank(seen, optimizer)}


def test_a_checkpoint_folder_some_rank_does_not_see_is_missing_on_every_rank(runs):
    for by_rank in runs:
        assert by_rank["exists"] == {"one rank sees it": False, "both see it": True}


def _seeded_per_rank(rank):
    """A model initialised differently on every rank, as nanoGPT's ``torch.manual_seed(1337 + rank)`` does, with a
    frozen bias among the optimizer's groups."""
    torch.manual_seed(1337 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    return model


def _per_rank_seeds(rank):
    """What DDP does at construction, ShardedOptimizer does by default: rank 0's parameters (the frozen members
    of its groups too) overwrite the others'; then training matches DDP's, which broadcast the same way."""
    out = {}
    model = _seeded_per_rank(rank)
    out["before"] = [p.detach().clone() for p in model.parameters()]
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    out["after"] = [p.detach().clone() for p in model.parameters()]
    reference = _seeded_per_rank(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ddp_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ddp(x).square().sum().backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
    out["trained"] = [p.detach().clone() for p in model.parameters()]
    out["ddp"] = [p.detach().clone() for p in reference.parameters()]
    # past the broadcast's flat size (FLAT_NUMEL): a contiguous parameter in place, a transposed one in a flat of
    # its own, small ones flattened around them
    torch.manual_seed(7 + rank)
    large = [torch.nn.Parameter(torch.randn(FLAT_NUMEL + 8)), torch.nn.Parameter(torch.randn(3, 2)),
             torch.nn.Parameter(torch.randn(8, FLAT_NUMEL // 8 + 1).t()), torch.nn.Parameter(torch.randn(5))]
    out["large before"] = [p.detach().clone() for p in large]
    ShardedOptimizer(large, torch.optim.SGD, lr=0.1)
    out["large after"] = [p.detach().clone() for p in large]
    return out


def test_rank_0s_parameters_are_broadcast_at_construction_as_ddp_does(runs):
    first = runs[0]["init_sync"]["before"]
    assert any(not torch.equal(a, b) for a, b in zip(first, runs[1]["init_sync"]["before"]))  # they differed
    for by_rank in runs:
        assert all(torch.equal(a, b) for a, b in zip(by_rank["init_sync"]["after"], first))


def test_parameters_larger_than_a_broadcast_flat_are_broadcast_too(runs):
    first = runs[0]["init_sync"]["large before"]
    assert not torch.equal(first[0], runs[1]["init_sync"]["large before"][0])
    for by_rank in runs:
        assert all(torch.equal(a, b) for a, b in zip(by_rank["init_sync"]["large after"], first))


def test_a_model_seeded_per_rank_trains_bitwise_as_under_ddp(runs):
    for by_rank in runs:
        out = by_rank["init_sync"]
        assert all(torch.equal(a, b) for a, b in zip(out["trained"], out["ddp"]))
        assert not all(torch.equal(a, b) for a, b in zip(out["trained"], out["after"]))  # it trained


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
    return {"lifecycle": _lifecycle(rank, world_size), "misuse": _misuse(rank, world_size),
            "init_sync": _per_rank_seeds(rank), "exists": _checkpoint_seen_by_some_ranks(rank)}


@pytest.fixture(scope="module")
def runs():
    """Both multi-rank checks in one launch of 2 ranks (each builds its own models and optimizers)."""
    return run_distributed(2, _both)


LIFECYCLE = {  # outcome -> check
    "second_owner1": lambda out: "already managed by another ShardedOptimizer" in out,
    "second_owner2": lambda out: "already managed by another ShardedOptimizer" in out,
    "released1": lambda out: out is True,  # the model's hooks do not keep a deleted optimizer alive
    "released2": lambda out: out is True,
    "failed": lambda out: "injected failure" in out,  # and training went on after zero_grad()
    "stale_graph": lambda out: "inplace operation" in out,
}


@pytest.mark.parametrize("outcome", sorted(LIFECYCLE))
def test_lifecycle_and_recovery(runs, outcome):
    for rank, by_rank in enumerate(runs):
        found = by_rank["lifecycle"][outcome]
        assert found is not None and LIFECYCLE[outcome](found), f"{outcome}, rank {rank}: {found!r}"
