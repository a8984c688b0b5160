"""Low-bit optimizers (bitsandbytes' 8-bit classes) sharded exactly: recognised without flags and cut into
flat shards on their quantization blocks, each parameter placed so that its pieces keep its 8-bit/fp32
choice by size, so that every block and every choice is the unsharded optimizer's. Reference: DDP + the same
optimizer, bitwise, at world sizes 2, 3 and 4 (at 3 and 4 on the same batch on every rank: see ``_train``), on
a model of odd sizes, where shard boundaries placed without blocks would fall inside blocks, and whose largest
matrix is cut between ranks."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from distributed import case_results, run_cases, run_distributed
from zeroimpl import ShardedOptimizer, estimate_memory
from zeroimpl.optimizer_kinds import sharding_of

bnb = pytest.importorskip("bitsandbytes", reason="pip install 'zeroimpl[lowbit]' (bitsandbytes)")

# PagedAdamW8bit pages its state on CUDA; on the CPU bitsandbytes falls back to plain buffers (with a warning)
CLASSES = {"AdamW8bit": (bnb.optim.AdamW8bit, {"lr": 1e-2}), "Adam8bit": (bnb.optim.Adam8bit, {"lr": 1e-2}),
           "Lion8bit": (bnb.optim.Lion8bit, {"lr": 1e-3}), "PagedAdamW8bit": (bnb.optim.PagedAdamW8bit, {"lr": 1e-2})}
# classes that scale each update by its norm against the parameter's (max_unorm, on by default): LAMB's and LARS's
# trust ratio, which needs the whole parameter; a high lr, so that the ratio bites
TRUST_RATIO_CLASSES = {"LAMB": (bnb.optim.LAMB, {"lr": 0.5}), "LAMB8bit": (bnb.optim.LAMB8bit, {"lr": 0.5}),
                       "LARS": (bnb.optim.LARS, {"lr": 0.5, "momentum": 0.9})}
STEPS = 3


class OddNet(torch.nn.Module):
    """Three layers, ``inputs -> hidden -> 61 -> 5``. By default of odd sizes: two matrices above bitsandbytes'
    4096-element threshold for 8-bit state (12707, 5917 elements: blocks of 256 do not divide them; the first
    large enough to be cut in pieces of 8-bit state on 2, 3 and 4 ranks) and the rest below it (fp32 state)."""

    def __init__(self, inputs: int = 131, hidden: int = 97):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(inputs, hidden), torch.nn.Linear(hidden, 61)
        self.head = torch.nn.Linear(61, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x))))).square().mean()


def _train(rank, name, sharded):
    model = OddNet()
    cls, kwargs = {**CLASSES, **TRUST_RATIO_CLASSES}[name]
    if sharded:
        optimizer, forward = ShardedOptimizer(model.parameters(), cls, stage=2, bucket_numel=2048, **kwargs), model
    else:
        optimizer, forward = cls(model.parameters(), **kwargs), DistributedDataParallel(model)
    # at world size 2 each rank its own batch; at 3 and 4 the same batch on every rank, so that the gradient
    # average is exact in any summation order (DDP's all-reduce and zeroimpl's reduce-scatter sum in different
    # orders, and 8-bit rounding of the state can turn their last-bit difference into 1e-4 -- measured alike
    # with whole-parameter shards): what is left to differ is the sharding alone
    data_rank = rank if torch.distributed.get_world_size() == 2 else 0
    for step in range(STEPS):
        x = torch.randn(8, 131, generator=torch.Generator().manual_seed(100 * step + data_rank))
        forward(x).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.held_tensors()["optimizer_state"] if sharded else None
    cut = None
    if sharded:  # how many ranks hold a piece of the largest matrix
        cut = sum(any(p.param_index == 0 for p in optimizer.layout.pieces(r)) for r in range(optimizer.world_size))  # estimate_memory, before anything is built, predicts this rank's state bytes exactly
        estimate = estimate_memory(OddNet().parameters(), optimizer.world_size, 2, optimizer_class=cls,
                                   optimizer_kwargs=kwargs, bucket_numel=2048, rank=optimizer.rank)
        assert estimate.device.optimizer_state == optimizer.memory_report().device.optimizer_state
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state, cut


def _parity(rank, name):
    (ours, state, cut), (reference, _, _) = _train(rank, name, True), _train(rank, name, False)
    quantized = [t for t in state if t.dtype == torch.uint8]
    return max((ours[n] - reference[n]).abs().max().item() for n in reference), sum(t.numel() for t in quantized), cut


def _all(rank, world_size, directory):
    cases = {name: partial(_parity, rank, name) for name in CLASSES}
    if world_size == 2:
        cases.update({name: partial(_parity, rank, name) for name in TRUST_RATIO_CLASSES})
        cases["resume"] = partial(_resume, rank, world_size, directory)
        cases["overrides"] = _overrides
        cases["whole from flat"] = partial(_loaded_whole_steps_as_the_plain_class, rank, directory, OddNet, 131,
                                           *CLASSES["AdamW8bit"], per_parameter=[CLASSES["AdamW8bit"][0]])
        cases["flat LAMB8bit"] = partial(_loaded_whole_steps_as_the_plain_class, rank, FLAT_LAMB8BIT,
                                         _flat_lamb8bit_model, 131, bnb.optim.LAMB8bit, {"lr": 1e-3})
    else:  # the 2-rank launch (run first) saved it
        cases["resharded"] = partial(_resharded, rank, directory)
    return run_cases(cases)


WORLD_SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """World size -> every rank's run_cases results (one launch each; the checkpoint case in the 2-rank one)."""
    directory = str(tmp_path_factory.mktemp("lowbit") / "checkpoint")
    return {world_size: run_distributed(world_size, _all, directory) for world_size in WORLD_SIZES}


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_bit_optimizers_train_bitwise_as_under_ddp(launches, world_size, name):
    results = launches[world_size]
    outcomes = case_results(results, name)
    assert all(difference == 0.0 for difference, _, _ in outcomes), [difference for difference, _, _ in outcomes]
    # the two large matrices hold 8-bit state, whichever ranks hold their pieces: 8-bit elements in all = their
    # sizes; and the largest is cut between ranks (with bucket_numel=2048: 2 ranks at world sizes 2 and 4, 3 at 3)
    per_state = 2 if name != "Lion8bit" else 1
    assert sum(quantized for _, quantized, _ in outcomes) == per_state * (131 * 97 + 97 * 61)
    assert all(cut == (3 if world_size == 3 else 2) for _, _, cut in outcomes), [cut for _, _, cut in outcomes]


@pytest.mark.parametrize("name", list(TRUST_RATIO_CLASSES))
def test_trust_ratio_classes_step_whole_parameters_bitwise_as_under_ddp(launches, name):
    """bitsandbytes' LAMB and LARS scale each update by its norm against the parameter's: on a piece of the
    largest matrix that ratio would differ (measured with flat shards, after 3 steps: LAMB 3.0e-3 from DDP, LAMB8bit
    0.30, LARS 4.1e-4)."""
    outcomes = case_results(launches[2], name)
    assert all(difference == 0.0 for difference, _, _ in outcomes), [difference for difference, _, _ in outcomes]
    assert sharding_of(TRUST_RATIO_CLASSES[name][0], (), False) == "whole"
    assert all(cut == 1 for _, _, cut in outcomes)  # the largest matrix is stepped whole, by one rank


def _trust_ratio_at_one_rank(rank, world_size):
    return run_cases({name: partial(_parity, rank, name) for name in TRUST_RATIO_CLASSES})


def test_trust_ratio_classes_at_one_rank_hold_what_estimate_memory_says():
    """One rank holds both 8-bit matrices: LAMB8bit's two quantization maps, shared by its parameters, are held
    (and estimated) once, not once per parameter (``_train`` compares the estimate with the memory report)."""
    (results,) = run_distributed(1, _trust_ratio_at_one_rank)
    for name in TRUST_RATIO_CLASSES:
        ((difference, _, cut),) = case_results([results], name)
        assert difference == 0.0 and cut == 1


def test_subclasses_of_trust_ratio_classes_and_an_args_object_are_not_sharded_flat():
    """A subclass whose constructor hides max_unorm in ``**kwargs`` is still stepped whole; bitsandbytes' ``args``
    object (which overrides the keyword arguments zeroimpl reads) is refused, naming the fix."""
    class MyLAMB(bnb.optim.LAMB):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
    assert sharding_of(MyLAMB, (), False) == "whole"
    settings = type("Settings", (), {"max_unorm": 1.0, "min_8bit_size": 4096})()
    with pytest.raises(ValueError, match=r"AdamW8bit\(args=...\).*pass the settings as keyword arguments"):
        ShardedOptimizer(OddNet().parameters(), bnb.optim.AdamW8bit, args=settings)
    with pytest.raises(ValueError, match=r"LAMB\(args=...\)"):  # stepped whole, but estimated alike
        estimate_memory(OddNet().parameters(), 2, optimizer_class=bnb.optim.LAMB, optimizer_kwargs={"args": settings})


@pytest.mark.parametrize("name", list(CLASSES))
def test_low_bit_classes_are_sharded_on_blocks_and_refuse_assume_elementwise(name):
    cls = CLASSES[name][0]
    assert sharding_of(cls, (), False) == "blocked"
    with pytest.raises(ValueError, match="quantizes its state in blocks.*leave assume_elementwise off"):
        sharding_of(cls, (), True)


def _resume(rank, world_size, directory):
    """AdamW8bit: 2 steps, a checkpoint, then 1 more step (a) after loading it into an optimizer of another
    bucket size, (b) with plain DDP + AdamW8bit from its consolidated torch state; both bitwise the
    uninterrupted run of the same kind."""
    from zeroimpl.checkpoint import consolidated_optimizer_state_dict, load_checkpoint, save_checkpoint
    cls, kwargs = CLASSES["AdamW8bit"]

    def steps(model, optimizer, forward, first, count):
        for step in range(first, first + count):
            x = torch.randn(8, 131, generator=torch.Generator().manual_seed(100 * step + rank))
            forward(x).backward()
            optimizer.step()
            optimizer.zero_grad()

    def sharded(bucket_numel):
        model = OddNet()
        return model, ShardedOptimizer(model.parameters(), cls, stage=2, bucket_numel=bucket_numel, **kwargs)

    model, optimizer = sharded(2048)
    steps(model, optimizer, model, 0, 2)
    save_checkpoint(directory, optimizer, model)
    steps(model, optimizer, model, 2, 1)
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    resumed, again = sharded(8192)
    load_checkpoint(directory, again, resumed)
    steps(resumed, again, resumed, 2, 1)
    plain_model = OddNet()
    plain = cls(plain_model.parameters(), **kwargs)
    reference_model = OddNet()
    reference = cls(reference_model.parameters(), **kwargs)
    ddp_reference = DistributedDataParallel(reference_model)
    steps(reference_model, reference, ddp_reference, 0, 2)
    plain_model.load_state_dict(reference_model.state_dict())  # (the weights are the same: checked below)
    plain.load_state_dict(consolidated_optimizer_state_dict(directory))
    steps(plain_model, plain, DistributedDataParallel(plain_model), 2, 1)
    steps(reference_model, reference, ddp_reference, 2, 1)
    return (all(torch.equal(p.detach(), uninterrupted[n]) for n, p in resumed.named_parameters()),
            all(torch.equal(p.detach(), q.detach()) for p, q in zip(plain_model.parameters(), reference_model.parameters())))


def test_low_bit_state_checkpoints_reshard_and_export_to_the_plain_optimizer(launches):
    for resharded, exported in case_results(launches[2], "resume"):
        assert resharded, "resumed with another bucket size: not the uninterrupted run"
        assert exported, "the consolidated torch state, loaded into bitsandbytes' AdamW8bit, trains differently"


def _resharded(rank, directory):
    """The 2-rank AdamW8bit checkpoint continued on 3 or 4 ranks, where the largest matrix is cut elsewhere (its
    blocks' scales move to other ranks): (a) through load_checkpoint, (b) through load_torch_optimizer_state of
    the consolidated torch state; one step each (the same batch on every rank), bitwise as DDP + AdamW8bit
    loaded from the consolidated state."""
    from zeroimpl.checkpoint import consolidated_optimizer_state_dict, load_checkpoint, load_torch_optimizer_state
    cls, kwargs = CLASSES["AdamW8bit"]
    x = torch.randn(8, 131, generator=torch.Generator().manual_seed(7))

    def step(model, optimizer, forward):
        forward(x).backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    loaded_model = OddNet()
    loaded = ShardedOptimizer(loaded_model.parameters(), cls, stage=2, bucket_numel=2048, **kwargs)
    load_checkpoint(directory, loaded, loaded_model)
    imported_model = OddNet()
    imported_model.load_state_dict(loaded_model.state_dict())
    imported = ShardedOptimizer(imported_model.parameters(), cls, stage=2, bucket_numel=2048, **kwargs)
    load_torch_optimizer_state(imported, consolidated_optimizer_state_dict(directory))
    reference_model = OddNet()
    reference_model.load_state_dict(loaded_model.state_dict())
    reference = cls(reference_model.parameters(), **kwargs)
    reference.load_state_dict(consolidated_optimizer_state_dict(directory))
    expected = step(reference_model, reference, DistributedDataParallel(reference_model))
    cut = sum(any(p.param_index == 0 for p in loaded.layout.pieces(r)) for r in range(loaded.world_size))
    return (cut, all(map(torch.equal, step(loaded_model, loaded, loaded_model), expected)),
            all(map(torch.equal, step(imported_model, imported, imported_model), expected)))


FLAT_LAMB8BIT = os.path.join(os.path.dirname(__file__), "data", "flat-lamb8bit")


def _loaded_whole_steps_as_the_plain_class(rank, directory, build, inputs, cls, kwargs, **zero_kwargs):
    """A checkpoint saved in flat pieces cut on blocks, loaded into an optimizer that steps every parameter whole
    (``per_parameter``, or a class stepped whole since it was saved): whether it does, and whether one step (a
    batch of ``inputs`` features per rank) is bitwise that of DDP + ``cls`` loaded from the checkpoint's
    consolidated torch state."""
    from zeroimpl.checkpoint import consolidated_optimizer_state_dict, load_checkpoint
    x = torch.randn(8, inputs, generator=torch.Generator().manual_seed(rank))
    model = build()
    optimizer = ShardedOptimizer(model.parameters(), cls, stage=2, **zero_kwargs, **kwargs)
    load_checkpoint(directory, optimizer, model)
    reference_model = build()
    reference_model.load_state_dict(model.state_dict())
    reference = cls(reference_model.parameters(), **kwargs)
    reference.load_state_dict(consolidated_optimizer_state_dict(directory))
    stepped = []
    for net, opt, forward in ((model, optimizer, model),
                              (reference_model, reference, DistributedDataParallel(reference_model))):
        forward(x).square().mean().backward()
        opt.step()
        stepped.append([p.detach().clone() for p in net.parameters()])
    return all(bucket.whole for bucket in optimizer.layout.buckets), all(map(torch.equal, *stepped))


FLAT_LAMB8BIT = os.path.join(os.path.dirname(__file__), "data", "flat-lamb8bit")


def _flat_lamb8bit_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(131, 97), torch.nn.Linear(97, 5))


def test_a_flat_checkpoint_loads_into_whole_parameter_stepping_and_steps_as_the_plain_class(launches):
    """AdamW8bit saved flat, loaded with per_parameter=[AdamW8bit]: a whole piece is cut on the saved blocks."""
    assert case_results(launches[2], "whole from flat") == [(True, True)] * 2


def test_an_old_flat_lamb8bit_checkpoint_loads_and_steps_as_the_plain_class(launches):
    """A LAMB8bit checkpoint saved by zeroimpl before 3d02466, which sharded it in flat pieces cut on blocks
    (tests/data/make_flat_lamb8bit_checkpoint.py), into today's whole-parameter stepping (before: refused,
    telling the user to load it into the class it was saved with, which they had)."""
    assert case_results(launches[2], "flat LAMB8bit") == [(True, True)] * 2


@pytest.mark.parametrize("world_size", [3, 4])
def test_low_bit_state_reshards_to_other_world_sizes(launches, world_size):
    for cut, loaded, imported in case_results(launches[world_size], "resharded"):
        assert cut > 1, "the largest matrix is not cut between ranks"
        assert loaded, "resumed from the 2-rank checkpoint: not DDP + AdamW8bit from its consolidated state"
        assert imported, "from the consolidated torch state: not DDP + AdamW8bit from it"


def _overrides():
    """bitsandbytes' per-parameter overrides (GlobalOptimManager) name the model's parameters, which the inner
    optimizer never sees (it steps pieces): refused at construction, on every rank."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    model = OddNet()
    manager.override_config(model.first.weight, "optim_bits", 32)
    try:
        ShardedOptimizer(model.parameters(), bnb.optim.AdamW8bit, bucket_numel=2048, lr=1e-2)
    except ValueError as error:
        return str(error)
    finally:
        manager.initialize()  # (a process-wide singleton: the next case starts without the override)
    return None


def test_bitsandbytes_per_parameter_overrides_are_refused_on_every_rank(launches):
    for message in case_results(launches[2], "overrides"):
        assert message is not None and "override_config" in message, message
