"""state_dict() / load_state_dict() on the same world size: resuming is bitwise uninterrupted training.

state_dict() is called on rank 0 alone mid-run (as Hugging Face Trainer does): it must not communicate.
"""

import copy

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer


def _make(dtype, stage, optimizer_name, offload=None):
    model = build_model("gpt2", dtype)
    optimizer_class, kwargs = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}),
                               "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}[optimizer_name]
    optimizer = ShardedOptimizer(param_groups(model), optimizer_class, stage=stage, bucket_numel=4096,
                                 offload=offload, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, schedule


def _train(rank, model, optimizer, schedule, steps):
    for step in steps:
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def _resume(rank, world_size, dtype, stage, optimizer_name, offload=None):
    model, optimizer, schedule = _make(dtype, stage, optimizer_name, offload)
    _train(rank, model, optimizer, schedule, range(3))
    if rank == 0:  # on one rank only: would hang if state_dict() communicated
        optimizer.state_dict()
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), schedule.state_dict()))
    _train(rank, model, optimizer, schedule, range(3, 6))
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, optimizer, schedule = _make(dtype, stage, optimizer_name, offload)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    schedule.load_state_dict(saved[2])
    _train(rank, model, optimizer, schedule, range(3, 6))
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    return uninterrupted, resumed, optimizer.loss_scale


ROUND_TRIPS = [
    (torch.float32, 1, "adamw", None), (torch.float32, 2, "sgd", None), (torch.bfloat16, 2, "adamw", None),
    (torch.float16, 1, "adamw", None), (torch.float32, 2, "adamw", "cpu"), (torch.float16, 2, "adamw", "cpu"),
    (torch.bfloat16, 1, "sgd", "cpu"),
]


@pytest.mark.parametrize("dtype,stage,optimizer_name,offload", ROUND_TRIPS)
def test_round_trip_resumes_bitwise(runs, dtype, stage, optimizer_name, offload):
    for by_rank in runs:
        uninterrupted, resumed, _ = by_rank["round_trips"][(dtype, stage, optimizer_name, offload)]
        for name in uninterrupted:
            assert torch.equal(uninterrupted[name], resumed[name]), name


def _mismatch(rank, world_size):
    model, optimizer, _ = _make(torch.float32, 2, "adamw")
    errors = {}
    other_rank = copy.deepcopy(optimizer.state_dict())
    other_rank["rank"] = 1 - rank
    plain = torch.optim.AdamW(build_model("gpt2").parameters()).state_dict()
    smaller = build_model("gpt2")
    smaller_opt = ShardedOptimizer(param_groups(smaller)[:1], torch.optim.AdamW, bucket_numel=4096)
    regrouped = build_model("gpt2")  # the same model, with all parameters in one param group
    regrouped_opt = ShardedOptimizer([{"params": list(regrouped.parameters())}], torch.optim.AdamW, bucket_numel=4096)
    states = {"other_rank": other_rank, "plain": plain, "other_model": smaller_opt.state_dict(),
              "other_groups": regrouped_opt.state_dict()}
    for name, state in states.items():
        try:
            optimizer.load_state_dict(state)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _all_runs(rank, world_size):
    """Every round trip, then the refusals, in one launch of 2 ranks (each builds its own model and optimizer)."""
    return {"round_trips": {config: _resume(rank, world_size, *config) for config in ROUND_TRIPS},
            "mismatch": _mismatch(rank, world_size)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _all_runs)


def test_mismatched_state_is_refused(runs):
    for errors in (by_rank["mismatch"] for by_rank in runs):
        assert "saved by rank" in errors["other_rank"]
        assert "param groups do not match" in errors["plain"]  # (a full torch state of other groups)
        assert "layout" in errors["other_model"] and "layout" in errors["other_groups"]


# -- in process --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 256, 4096])
def test_a_low_bit_pieces_scales_and_map_are_piece_level_whatever_its_length(length):
    """bitsandbytes' state of a piece of ``length`` elements: ``qmap1`` has 256 entries and ``absmax1`` one per
    block of 256, so a 256-element piece's map (or a 1-element piece's scale) has the piece's shape. Catches:
    either filed as per-element state (resharded element by element, its block structure lost)."""
    from zeroimpl.state_format import split_state

    state = {"step": torch.tensor(1.0), "state1": torch.zeros(length, dtype=torch.uint8),
             "qmap1": torch.linspace(-1, 1, 256), "absmax1": torch.ones(-(-length // 256))}
    elementwise, scalars, piece_level = split_state(state, (length,), whole=True)
    assert set(elementwise) == {"state1"} and set(scalars) == {"step"} and set(piece_level) == {"qmap1", "absmax1"}


class _OtherSubclass(torch.Tensor):
    """A tensor subclass of unknown layout (it declares the flatten protocol, as torchao's states do)."""

    def __tensor_flatten__(self):
        return [], None


def test_optimizer_state_of_an_unknown_tensor_subclass_is_refused_by_name():
    """Checkpoints store torchao's three quantized state classes part by part; any other subclass's layout is
    unknown, so splitting it into per-element and per-block parts would be a guess: refused, naming it."""
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.state_format import split_state

    state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8).as_subclass(_OtherSubclass)}
    with pytest.raises(CheckpointError, match="'exp_avg' is a _OtherSubclass .*cannot reshard"):
        split_state(state, (8,), whole=True)


def test_a_state_key_that_merely_ends_like_a_stored_part_is_not_taken_for_one():
    """A stored torchao value's recipe is ``key/tensor`` holding (class name, signed, dtype); a user's own state
    under such a key name, of another kind, is checked as any state (a string is neither per element nor a
    scalar: refused at save time, not mistaken for a recipe that fails on load)."""
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.state_format import split_state

    with pytest.raises(CheckpointError, match="'foo/tensor'.*neither one value per element nor a scalar"):
        split_state({"step": torch.tensor(1.0), "foo/tensor": "abc"}, (8,), whole=False)


def test_a_state_keyed_by_a_number_splits_as_any_state_outside_whole_parameter_stepping():
    """A custom optimizer may key its state by numbers; the names of low-bit piece-level parts are looked for only
    where pieces are stepped whole, so elsewhere such a state splits into per-element values and scalars."""
    from zeroimpl.state_format import split_state

    elementwise, scalars, piece_level = split_state({0: torch.zeros(4), "step": torch.tensor(1.0)}, (4,), whole=False)
    assert set(elementwise) == {0} and set(scalars) == {"step"} and piece_level == {}
