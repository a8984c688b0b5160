"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) sharded exactly: recognised without flags, cut
into flat shards on their quantization blocks (256 elements; 128 for 4-bit), and checkpointed with each block's
codes and scale moving together. Reference: DDP + the same torchao class, bitwise, at world sizes 2, 3 and 4 on
:class:`TwoMatrices`.

One launch per world size; the 2-rank launch saves a checkpoint per class, which the 3- and 4-rank launches
continue from. torchao compiles its step (``torch.compile``, once per tensor shape, in every process): that is how
users run it, and how AdamW8bit runs at world size 2 here (both sides, with checkpoints). Every other case runs
torchao's step eagerly (``torch.compiler.set_stance("force_eager")``), zeroimpl and its DDP reference alike: the
same torchao arithmetic, which is what the sharding has to preserve, without about 100 s of compilation on 2
cores with a cold inductor cache (the whole module took 96-101 s compiled, 43 s warm)."""

from __future__ import annotations

import io
from functools import partial

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from distributed import case_results, run_cases, run_distributed
from zeroimpl import ShardedOptimizer, estimate_memory
from zeroimpl.optimizer_kinds import sharding_of

ao = pytest.importorskip("torchao.optim", reason="pip install 'zeroimpl[lowbit]' (torchao)")
CLASSES = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
STEPS, LR = 3, 1e-2
WORLD_SIZES = [2, 3, 4]
COMPILED = {(2, "AdamW8bit")}  # (world size, class) whose cases run torchao's step compiled


class TwoMatrices(torch.nn.Module):
    """``128 -> 96 -> 61``, no biases: a 96 x 128 matrix whose state torchao quantizes (at least 4096 elements,
    whole blocks of 256 and of 128), cut between ranks, and a 61 x 96 one (5856 elements, not whole blocks:
    fp32 state) on one rank. Two shapes only: torchao compiles its step once per shape, in every process."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(128, 96, bias=False), torch.nn.Linear(96, 61, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    """At world size 2 each rank its own batch; at 3 and 4 the same on every rank (so that the gradient average
    is exact in any summation order, as in tests/test_optimizer_kinds_lowbit.py: what is left to differ is the
    sharding)."""
    data_rank = rank if torch.distributed.get_world_size() == 2 else 0
    return torch.randn(8, 128, generator=torch.Generator().manual_seed(100 * step + data_rank))


def _steps(model, optimizer, forward, first: int, count: int, rank: int) -> None:
    for step in range(first, first + count):
        forward(_batch(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.finish_param_gathers()  # (torchao's compiled step must not run under the in-flight guard)


def _sharded(cls):
    model = TwoMatrices()
    return model, ShardedOptimizer(model.parameters(), cls, stage=2, bucket_numel=4096, lr=LR)


def _plain(cls):
    model = TwoMatrices()
    return model, cls(model.parameters(), lr=LR)


def _parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _parity(rank, name, directory):
    """STEPS steps against DDP + the same class; at world size 2 the checkpoint the larger launches continue
    from. (difference, ranks holding a piece of the 128 x 96 matrix, estimate_memory exact, state quantized)."""
    from zeroimpl.checkpoint import save_checkpoint
    cls = getattr(ao, name)
    model, optimizer = _sharded(cls)
    _steps(model, optimizer, model, 0, STEPS, rank)
    reference, plain = _plain(cls)
    _steps(reference, plain, DistributedDataParallel(reference), 0, STEPS, rank)
    if torch.distributed.get_world_size() == 2:
        save_checkpoint(f"{directory}-{name}", optimizer, model)
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    world = optimizer.world_size
    cut = sum(any(p.param_index == 0 for p in optimizer.layout.pieces(r)) for r in range(world))
    estimate = estimate_memory(TwoMatrices().parameters(), world, 2, optimizer_class=cls,
                               optimizer_kwargs={"lr": LR}, bucket_numel=4096, rank=rank)
    exact = estimate.device.optimizer_state == optimizer.memory_report().device.optimizer_state
    quantized = any(hasattr(type(v), "__tensor_flatten__") for s in optimizer.inner.state.values() for v in s.values())
    return difference, cut, exact, quantized


def _resume(rank, name, directory):
    """World size 2: after STEPS steps (as saved by _parity), one more step (a) from load_checkpoint, (b) from the per-rank torch.save'd state_dict(), (c) with plain DDP + the
    class from the consolidated torch state: each bitwise the uninterrupted run of its kind."""
    from zeroimpl.checkpoint import consolidated_optimizer_state_dict, load_checkpoint
    cls, saved = getattr(ao, name), f"{directory}-{name}"
    model, optimizer = _sharded(cls)
    _steps(model, optimizer, model, 0, STEPS, rank)
    buffer, weights = io.BytesIO(), {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(optimizer.state_dict(), buffer)
    _steps(model, optimizer, model, STEPS, 1, rank)
    loaded_model, loaded = _sharded(cls)
    load_checkpoint(saved, loaded, loaded_model)
    _steps(loaded_model, loaded, loaded_model, STEPS, 1, rank)
    restored_model, restored = _sharded(cls)
    restored_model.load_state_dict(weights)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    _steps(restored_model, restored, restored_model, STEPS, 1, rank)

    reference, plain = _plain(cls)
    ddp = DistributedDataParallel(reference)
    _steps(reference, plain, ddp, 0, STEPS, rank)
    exported_model, exported = _plain(cls)
    exported_model.load_state_dict(reference.state_dict())
    exported.load_state_dict(consolidated_optimizer_state_dict(saved))
    _steps(exported_model, exported, DistributedDataParallel(exported_model), STEPS, 1, rank)
    _steps(reference, plain, ddp, STEPS, 1, rank)
    uninterrupted = _parameters(model)
    return (all(map(torch.equal, _parameters(loaded_model), uninterrupted)),
            all(map(torch.equal, _parameters(restored_model), uninterrupted)),
            all(map(torch.equal, _parameters(exported_model), _parameters(reference))))


def _resharded(rank, name, directory):
    """World sizes 3 and 4: the 2-rank checkpoint continued (its blocks' codes and scales move to other ranks)
    (a) through load_checkpoint, (b) through load_torch_optimizer_state of the consolidated torch state; one
    step each, bitwise DDP + the class loaded from the consolidated state. (ranks holding a piece of the
    128 x 96 matrix, (a), (b))."""
    from zeroimpl.checkpoint import consolidated_optimizer_state_dict, load_checkpoint, load_torch_optimizer_state
    cls, saved = getattr(ao, name), f"{directory}-{name}"
    loaded_model, loaded = _sharded(cls)
    load_checkpoint(saved, loaded, loaded_model)
    imported_model, imported = _sharded(cls)
    imported_model.load_state_dict(loaded_model.state_dict())
    load_torch_optimizer_state(imported, consolidated_optimizer_state_dict(saved))
    reference, plain = _plain(cls)
    reference.load_state_dict(loaded_model.state_dict())
    plain.load_state_dict(consolidated_optimizer_state_dict(saved))
    _steps(reference, plain, DistributedDataParallel(reference), STEPS, 1, rank)
    _steps(loaded_model, loaded, loaded_model, STEPS, 1, rank)
    _steps(imported_model, imported, imported_model, STEPS, 1, rank)
    expected = _parameters(reference)
    cut = sum(any(p.param_index == 0 for p in loaded.layout.pieces(r)) for r in range(loaded.world_size))
    return (cut, all(map(torch.equal, _parameters(loaded_model), expected)),
            all(map(torch.equal, _parameters(imported_model), expected)))


def _with_stance(compiled: bool, case):
    """Run ``case`` with torch.compile on (``compiled``) or forced eager; return (whether dynamo compiled a new
    graph while it ran, its result)."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("default" if compiled else "force_eager"):
        result = case()
    return counters["stats"]["unique_graphs"] > before, result


def _all(rank, world_size, directory):
    cases = {}
    for name in CLASSES:
        compiled = (world_size, name) in COMPILED
        cases[name] = partial(_with_stance, compiled, partial(_parity, rank, name, directory))
        if world_size == 2:
            cases[(name, "resume")] = partial(_with_stance, compiled, partial(_resume, rank, name, directory))
        else:  # the 2-rank launch (run first) saved it
            cases[(name, "resharded")] = partial(_with_stance, compiled, partial(_resharded, rank, name, directory))
    if world_size == 2:
        cases["channels last into whole"] = partial(_channels_last_into_whole_parameter_stepping,
                                                    directory + "-channels-last")
    return run_cases(cases)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """World size -> every rank's run_cases results."""
    directory = str(tmp_path_factory.mktemp("torchao") / "checkpoint")
    return {world_size: run_distributed(world_size, _all, directory, timeout=600) for world_size in WORLD_SIZES}


def test_torchao_classes_are_recognised_and_sharded_on_blocks():
    for name in CLASSES:
        assert sharding_of(getattr(ao, name), (), False) == "blocked"
        with pytest.raises(ValueError, match="quantizes its state in blocks"):
            sharding_of(getattr(ao, name), (), True)


def _outcomes(launches, world_size, case):
    """Every rank's result of ``case`` at ``world_size``, after checking how torchao's step ran: no graph compiled
    in an eager case, and new graphs in a compiled class's first case (its later cases reuse them)."""
    name = case if isinstance(case, str) else case[0]
    ran = case_results(launches[world_size], case)
    if (world_size, name) not in COMPILED:
        assert not any(compiled for compiled, _ in ran), "compiled in a case meant to run eagerly"
    elif case == name:
        assert all(compiled for compiled, _ in ran), "torchao's step was not compiled"
    return [result for _, result in ran]


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torchao_classes_train_bitwise_as_under_ddp(launches, world_size, name):
    outcomes = _outcomes(launches, world_size, name)
    for difference, cut, exact, _ in outcomes:
        assert difference == 0.0, difference
        assert cut > 1, "the 128 x 96 matrix is not cut between ranks"
        assert exact, "estimate_memory is not the optimizer's state"
    assert sum(quantized for _, _, _, quantized in outcomes) > 1, "the matrix's pieces do not keep quantized state"


@pytest.mark.parametrize("name", CLASSES)
def test_torchao_checkpoints_resume_and_export_to_the_plain_optimizer(launches, name):
    for loaded, restored, exported in _outcomes(launches, 2, (name, "resume")):
        assert loaded, "resumed from the sharded checkpoint: not the uninterrupted run"
        assert restored, "resumed from its torch.save'd state_dict(): not the uninterrupted run"
        assert exported, "the consolidated torch state, loaded into the plain torchao class, trains differently"


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("world_size", [3, 4])
def test_torchao_checkpoints_reshard_to_other_world_sizes(launches, world_size, name):
    for cut, loaded, imported in _outcomes(launches, world_size, (name, "resharded")):
        assert cut > 1, "the 128 x 96 matrix is not cut between ranks"
        assert loaded, "resumed from the 2-rank checkpoint: not DDP + the class from its consolidated state"
        assert imported, "from the consolidated torch state: not DDP + the class from it"


@pytest.mark.parametrize("name", ["OptimState8bit", "OptimState4bit", "OptimStateFp8"])
def test_stored_codes_are_one_per_element_in_order_and_rebuild_the_same_state(name):
    """In one process, no step: a quantized state's stored parts, read element by element (code -> map or fp8
    value, times its block's scale), are torchao's own dequantized values, so every element keeps its code
    wherever a reshard moves it (4-bit: the first element of a byte is its high nibble); and the rebuilt state
    is the original, code for code."""
    import importlib

    from zeroimpl.state_format import CLASSES as MODULES, joined, plain_parts
    cls = getattr(importlib.import_module(MODULES[name]), name)
    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    state = cls.zeros(values.shape, block_size=128) if name == "OptimStateFp8" else cls.zeros(values.shape, True, 128)
    state.copy_(values)
    parts = plain_parts({"exp_avg": state, "step": torch.tensor(3.0)})
    codes, scale = parts["exp_avg/codes"], parts["exp_avg/scale"].repeat_interleave(128).view(64, 128)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape and parts["step"] == 3.0
    decoded = (codes.view(torch.float8_e4m3fn).float() if name == "OptimStateFp8" else parts["exp_avg/qmap"][codes.long()])
    assert torch.equal(decoded * scale, state.dequantize())
    rebuilt = joined(parts, (64, 128))["exp_avg"]
    assert type(rebuilt) is cls and torch.equal(rebuilt.scale, state.scale)
    assert torch.equal(rebuilt.codes.view(torch.uint8), state.codes.view(torch.uint8))


def test_export_or_import_of_a_non_contiguous_quantized_parameter_is_refused():
    """zeroimpl's blocks follow a parameter's memory order, the plain class's its logical order: a channels-last
    weight's state would land its scales on other elements, so it is refused (a sharded resume stays exact)."""
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.state_format import plain_parts, require_logical_order
    from torchao.optim.subclass_8bit import OptimState8bit
    parts = plain_parts({"exp_avg": OptimState8bit.zeros((16, 64, 2, 2), True, 256)})
    require_logical_order(parts, (16, 64, 2, 2), (256, 4, 2, 1), 0)  # contiguous: fine
    with pytest.raises(CheckpointError, match="memory order.*logical order.*load_checkpoint"):
        require_logical_order(parts, (16, 64, 2, 2), (256, 1, 128, 64), 0)  # channels last



def _channels_last_into_whole_parameter_stepping(directory):
    """A channels-last conv weight's AdamW8bit state saved from flat shards (eager: no compile), loaded with
    per_parameter=[AdamW8bit]: the error."""
    from zeroimpl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def conv():
        torch.manual_seed(0)
        return torch.nn.Conv2d(64, 16, 2).to(memory_format=torch.channels_last)  # 4096 elements: 8-bit state

    with torch.compiler.set_stance("force_eager"):
        model = conv()
        optimizer = ShardedOptimizer(model.parameters(), ao.AdamW8bit, stage=2, lr=1e-3)
        model(torch.randn(2, 64, 3, 3).to(memory_format=torch.channels_last)).square().mean().backward()
        optimizer.step()
        save_checkpoint(directory, optimizer, model)
        model = conv()
        whole = ShardedOptimizer(model.parameters(), ao.AdamW8bit, stage=2, lr=1e-3, per_parameter=[ao.AdamW8bit])
        try:
            load_checkpoint(directory, whole, model)
        except CheckpointError as error:
            return str(error)
    return "loaded"


def test_a_non_contiguous_parameters_flat_state_is_refused_for_whole_parameter_stepping(launches):
    """Flat shards quantize in blocks of memory order, whole-parameter stepping (the plain class) in blocks of
    logical order: loaded, the scales would fall on other elements (silently, before)."""
    for message in case_results(launches[2], "channels last into whole"):
        assert "memory order" in message and "logical order" in message and "per_parameter" in message, message
