"""bf16 and fp16 models with fp32 master shards, and fp16 dynamic loss scaling across ranks.

16-bit runs track the fp32 run of the same optimizer and settings (AdamW lr 1e-2, clipping, accumulation):
losses within HALF_LOSS_ATOL = 5e-3, parameters within HALF_PARAM_RTOL = 3e-2 in relative L2 norm after 6
steps (tests/workloads.py gives the measured values and the reasons; tests/test_cuda.py uses them too).
"""

from functools import partial

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import (HALF_LOSS_ATOL, HALF_PARAM_RTOL, RunConfig, batch, build_model, param_groups, relative_l2,
                       train)
from zeroimpl import LossScaleConfig, ShardedOptimizer


def _tracking_run(stage, dtype):
    return train(RunConfig("gpt2", stage, accum=2, steps=6, dtype=dtype, clip=(1.0, 2.0)))


@pytest.fixture(scope="module")
def runs():
    """Every run of this file in one launch of 2 ranks, one case each (``run_cases``: a case that raises fails
    its own tests only); each builds its own model and optimizer."""
    return run_distributed(2, _all_runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_tracks_fp32(runs, dtype):
    for stage in (1, 2):
        for run, reference in zip(case_results(runs, ("tracking", stage, dtype)),
                                  case_results(runs, ("tracking", stage, torch.float32))):
            assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"])) <= HALF_LOSS_ATOL
            assert relative_l2(run["params"], reference["params"]) <= HALF_PARAM_RTOL
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


def _redone_run(rank, world_size, stage):
    """fp16 GPT-2 reduced in fp16, two micro-batches: each parameter's gradient norm (fp32) in a fresh round, and
    in the same round run again after a first micro-batch was read through param.grad (which unscales, widening the
    shards to fp32) and cleared with zero_grad(set_to_none=False)."""
    norms = []
    for redo in (False, True):
        model = build_model("gpt2", torch.float16)
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2,
                                     reduce_dtype=torch.float16)
        if redo:
            optimizer.backward(model(**batch(rank, 0, 0)).loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            optimizer.zero_grad(set_to_none=False)
        for micro in range(2):
            optimizer.backward(model(**batch(rank, 0, micro)).loss)
        norms.append([torch.linalg.vector_norm(p.grad, dtype=torch.float32).item()
                      for p in model.parameters() if p.grad is not None])
    return norms
TINY_GRADIENT, SCALE = 3e-7, 4096.0  # scaled, a normal fp16 number; unscaled, below fp16's smallest normal (6.1e-5)


def _unscaled_run(rank, world_size, stage):
    """An fp16 bias whose gradient is TINY_GRADIENT on every rank, reduced in fp16: the unscaled gradient's
    inf-norm (read through param.grad, in fp32)."""
    bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    optimizer = ShardedOptimizer([bias], torch.optim.SGD, stage=stage, lr=1.0, reduce_dtype=torch.float16,
                                 loss_scale=LossScaleConfig(initial_scale=SCALE))
    optimizer.backward((bias * TINY_GRADIENT).sum())
    return torch.linalg.vector_norm(bias.grad, float("inf"), dtype=torch.float32).item()


def _all_runs(rank, world_size):
    cases = {("tracking", stage, dtype): partial(_tracking_run, stage, dtype)
             for stage in (1, 2) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    for stage, offload in OVERFLOW_CASES:
        cases[("overflow", stage, offload)] = partial(_overflow_run, rank, world_size, stage, 1, (1,), offload)
    cases["hysteresis"] = partial(_overflow_run, rank, world_size, 2, 2, (1, 2))
    for stage in (1, 2):
        cases[("unscaled", stage)] = partial(_unscaled_run, rank, world_size, stage)
        cases[("redone", stage)] = partial(_redone_run, rank, world_size, stage)
    return run_cases(cases)


@pytest.mark.parametrize("stage,offload", OVERFLOW_CASES)
def test_fp16_overflow_skipped_on_every_rank_and_scale_backs_off(runs, stage, offload):
    for records in case_results(runs, ("overflow", stage, offload)):
        assert [r["changed"] for r in records] == [True, False, True, True]
        assert [r["scale"] for r in records] == [1024.0, 512.0, 512.0, 512.0]
        assert all(r["finite"] for r in records)


def test_fp16_hysteresis_delays_backoff(runs):
    for records in case_results(runs, "hysteresis"):
        assert [r["changed"] for r in records] == [True, False, False, True]
        assert [r["scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_16bit_gradient_shard_is_unscaled_in_fp32(runs, stage):
    """Reduced in fp16 (``reduce_dtype``), a gradient is unscaled after widening to fp32, as DeepSpeed unscales
    its fp32 gradient partition: in fp16, 3e-7 would round to a subnormal (5 x 2**-24 = 2.98e-7)."""
    scaled = torch.tensor(TINY_GRADIENT * SCALE, dtype=torch.float16)  # the gradient autograd gives (every rank)
    expected = (scaled.float() * (1.0 / SCALE)).item()
    assert expected != (scaled * (1.0 / SCALE)).float().item()  # (what unscaling in fp16 gives)
    for norm in case_results(runs, ("unscaled", stage)):
        assert norm == expected


@pytest.mark.parametrize("stage", [1, 2])
def test_a_round_after_zero_grad_without_none_sums_as_a_fresh_one(runs, stage):
    """The widened fp32 shard does not outlive zero_grad(set_to_none=False): the next round sums its fp16
    reductions in fp16, as a fresh round does."""
    for fresh, redone in case_results(runs, ("redone", stage)):
        assert redone == fresh
