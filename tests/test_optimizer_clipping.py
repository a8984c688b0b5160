"""Other optimizers and clip_grad_norm_ against DDP + torch.nn.utils.clip_grad_norm_ at world size 2.

The 2-norm is summed in another order than torch's (per-shard partial sums, then across ranks), so it
agrees to NORM_RTOL = 1e-6; the inf-norm (a max) is exact. Parameters then agree within
SGD_ATOL = 1e-6 (SGD is linear in the clip coefficient) and ADAM_ATOL = 1e-4 (see test_optimizer_parity.py).
fp64 models (AdamW): FP64_RTOL = 1e-12 on norms, FP64_ATOL = 1e-10 on parameters.
"""

import pytest
import torch

from distributed import run_distributed
from workloads import RunConfig, bitwise_equal, max_param_diff, train

NORM_RTOL = 1e-6
SGD_ATOL = 1e-6
ADAM_ATOL = 1e-4
FP64_RTOL = 1e-12
FP64_ATOL = 1e-10
CLIPS = {"none": None, "l2": (0.5, 2.0), "inf": (0.05, float("inf"))}
ABOVE = (1e3, 2.0)  # a max_norm above every step's norm: clipping must leave the gradients as they are


def _runs(rank, world_size):
    results = {}
    for optimizer in ("sgd", "adam", "adamw"):
        for clip_name, clip in CLIPS.items():
            for stage in (None, 1, 2):
                results[(optimizer, clip_name, stage)] = train(
                    RunConfig("gpt2", stage, optimizer=optimizer, clip=clip, accum=2))
    for stage in (None, 1, 2):
        results[("adamw", "above", stage)] = train(RunConfig("gpt2", stage, clip=ABOVE, accum=2))
    for clip_name, clip in CLIPS.items():
        for stage in (None, 1, 2):
            results[("adamw", clip_name, stage, "fp64")] = train(
                RunConfig("gpt2", stage, clip=clip, accum=2, dtype=torch.float64))
    return results


def _all_runs(rank, world_size):
    return {"runs": _runs(rank, world_size), "edited_lr": _edited_lr(rank, world_size)}


@pytest.fixture(scope="module")
def launch():
    """Every run of this file in one launch of 2 ranks (each builds its own model and optimizer)."""
    return run_distributed(2, _all_runs)


@pytest.fixture(scope="module")
def results(launch):
    return [by_rank["runs"] for by_rank in launch]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_unclipped_stage1_is_bitwise(results, optimizer):
    for rank_results in results:
        assert bitwise_equal(rank_results[(optimizer, "none", 1)], rank_results[(optimizer, "none", None)])


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("clip_name", ["l2", "inf"])
@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_matches_torch(results, optimizer, clip_name, stage):
    for rank_results in results:
        run, reference = rank_results[(optimizer, clip_name, stage)], rank_results[(optimizer, clip_name, None)]
        assert len(run["norms"]) == len(reference["norms"]) == 4
        for norm, expected in zip(run["norms"], reference["norms"]):
            assert abs(norm - expected) <= NORM_RTOL * expected
        assert any(n > CLIPS[clip_name][0] for n in reference["norms"]), "the test must actually clip"
        atol = SGD_ATOL if optimizer == "sgd" else ADAM_ATOL
        assert max_param_diff(run["params"], reference["params"]) <= atol


@pytest.mark.parametrize("stage", [None, 1, 2])
def test_a_norm_below_max_norm_leaves_the_gradients_unchanged(results, stage):
    """The clip coefficient is clamped at 1 (as in torch): clipping at a max_norm above the norm changes no
    bit of the run (here against the same run without clipping)."""
    for rank_results in results:
        clipped, unclipped = rank_results[("adamw", "above", stage)], rank_results[("adamw", "none", stage)]
        assert clipped["norms"] and all(n < ABOVE[0] for n in clipped["norms"])  # the edge is exercised
        assert clipped["losses"] == unclipped["losses"]
        assert all(torch.equal(clipped["params"][n], p) for n, p in unclipped["params"].items())


@pytest.mark.parametrize("clip_name", ["none", "l2", "inf"])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp64_models_clip_and_step_like_torch(results, clip_name, stage):
    """fp64 gradient shards: norms and the NaN/Inf check in fp64 (fp32 would be a narrowing torch refuses);
    within FP64_RTOL of DDP's norms, FP64_ATOL of its parameters (summation order only)."""
    for rank_results in results:
        run, reference = rank_results[("adamw", clip_name, stage, "fp64")], rank_results[("adamw", clip_name, None, "fp64")]
        assert run["params"] and all(p.dtype == torch.float64 for p in run["params"].values())
        for norm, expected in zip(run["norms"], reference["norms"]):
            assert abs(norm - expected) <= FP64_RTOL * expected
        assert max_param_diff(run["params"], reference["params"]) <= FP64_ATOL


def test_norm_identical_on_every_rank(results):
    for key in results[0]:
        assert results[0][key]["norms"] == results[1][key]["norms"], key


def _edited_lr(rank, world_size):
    import torch

    from workloads import batch, build_model, param_groups
    from zeroimpl import ShardedOptimizer

    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.SGD, stage=1, lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.param_groups[0]["lr"] = 0.0  # a user edit of a live param group
    optimizer.param_groups[1]["lr"] = 0.0
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    optimizer.step()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return unchanged, optimizer.inner.param_groups[0]["lr"], sorted(optimizer.param_groups[0])


def test_param_groups_are_live(launch):
    for unchanged, inner_lr, keys in (by_rank["edited_lr"] for by_rank in launch):
        assert unchanged and inner_lr == 0.0
        assert {"lr", "momentum", "weight_decay", "nesterov"} <= set(keys)  # filled from the inner defaults
