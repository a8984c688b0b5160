"""bf16 and fp16 models with fp32 master shards, and fp16 dynamic loss scaling across ranks.

16-bit runs track the fp32 run of the same optimizer and settings (AdamW lr 1e-2, clipping, accumulation):
* losses within LOSS_ATOL = 5e-3 (bf16 keeps 8 significant bits; measured 1.3e-3 for bf16, 5e-4 fp16);
* parameters within PARAM_RTOL = 3e-2 in relative L2 norm over the model after 6 steps (measured 1.6e-2
  bf16, 6e-3 fp16): at lr 1e-2 six Adam steps move weights by several times their init std of 0.02, and
  Adam turns 16-bit rounding of near-zero gradients into steps of up to lr.
"""

import pytest
import torch

from distributed import run_distributed
from workloads import RunConfig, batch, build_model, param_groups, train
from zeroimpl import LossScaleConfig, ShardedOptimizer

LOSS_ATOL = 5e-3
PARAM_RTOL = 3e-2


def _tracking_runs(rank, world_size):
    results = {}
    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            results[(stage, dtype)] = train(RunConfig("gpt2", stage, accum=2, steps=6, dtype=dtype, clip=(1.0, 2.0)))
    return results


def _relative_l2(params, reference):
    diff = sum(((params[n] - reference[n]) ** 2).sum() for n in params) ** 0.5
    return (diff / sum((reference[n] ** 2).sum() for n in reference) ** 0.5).item()


@pytest.fixture(scope="module")
def runs():
    """Every run of this file in one launch of 2 ranks (each builds its own model and optimizer)."""
    return run_distributed(2, _all_runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_tracks_fp32(runs, dtype):
    for rank_results in (by_rank["tracking"] for by_rank in runs):
        for stage in (1, 2):
            run, reference = rank_results[(stage, dtype)], rank_results[(stage, torch.float32)]
            assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"])) <= LOSS_ATOL
            assert _relative_l2(run["params"], reference["params"]) <= PARAM_RTOL
            assert run["losses"] != reference["losses"]  # it really ran in 16 bits


def _overflow_run(rank, world_size, stage, hysteresis, overflow_steps, offload=None):
    """fp16 GPT-2; on rank 1 only, an inf is injected into one gradient at the given steps."""
    model = build_model("gpt2", torch.float16)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2, offload=offload,
                                 loss_scale=LossScaleConfig(initial_scale=1024.0, hysteresis=hysteresis))
    target = model.transformer.h[0].mlp.c_fc.weight
    records = []
    for step in range(4):
        inject = rank == 1 and step in overflow_steps
        handle = target.register_hook(lambda g: g * float("inf")) if inject else None
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.step()
        optimizer.zero_grad()
        if handle:
            handle.remove()
        changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        records.append({"scale": optimizer.loss_scale, "changed": changed,
                        "finite": all(torch.isfinite(p).all().item() for p in model.parameters())})
    return records


OVERFLOW_CASES = [(1, None), (2, None), (1, "cpu"), (2, "cpu")]


def _all_runs(rank, world_size):
    return {"tracking": _tracking_runs(rank, world_size),
            "overflow": {(stage, offload): _overflow_run(rank, world_size, stage, 1, (1,), offload)
                         for stage, offload in OVERFLOW_CASES},
            "hysteresis": _overflow_run(rank, world_size, 2, 2, (1, 2))}


@pytest.mark.parametrize("stage,offload", OVERFLOW_CASES)
def test_fp16_overflow_skipped_on_every_rank_and_scale_backs_off(runs, stage, offload):
    for records in (by_rank["overflow"][(stage, offload)] for by_rank in runs):
        assert [r["changed"] for r in records] == [True, False, True, True]
        assert [r["scale"] for r in records] == [1024.0, 512.0, 512.0, 512.0]
        assert all(r["finite"] for r in records)


def test_fp16_hysteresis_delays_backoff(runs):
    for records in (by_rank["hysteresis"] for by_rank in runs):
        assert [r["changed"] for r in records] == [True, False, False, True]
        assert [r["scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0]
