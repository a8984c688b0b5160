"""``overlap_param_gather=True``: each bucket's parameter all-gather stays in flight after ``step()`` and is
waited for just before the forward of the first module holding one of its parameters. Results must be
bitwise those of the default mode (the same collectives, waited for later), and every path that reads the
parameters in between must see the new values: a forward (also under ``no_grad`` / ``eval``), checkpoints,
``verify_ranks_agree``, and a user's read after ``finish_param_gathers()``.
"""

import os

import pytest
import torch

from distributed import run_distributed
from workloads import RunConfig, batch, bitwise_equal, build_model, param_groups, train
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.checkpoint import export_fp32_state_dict, save_checkpoint

CASES = {"stage 1": {"stage": 1}, "stage 2": {"stage": 2}, "stage 2 + offload": {"stage": 2, "offload": True},
         "stage 2, accumulation": {"stage": 2, "accum": 2}}


def _runs(rank, world_size):
    results = {}
    for name, case in CASES.items():
        zero_kwargs = {"offload": CPUOffload(fused_step=False)} if case.get("offload") else {}
        for overlap in (False, True):
            config = RunConfig("llama", case["stage"], accum=case.get("accum", 1), clip=(1.0, 2.0),
                               zero_kwargs={**zero_kwargs, "overlap_param_gather": overlap})
            results[(name, overlap)] = train(config)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _runs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_gathers_give_bitwise_the_same_training(runs, case):
    for by_rank in runs:
        assert bitwise_equal(by_rank[(case, True)], by_rank[(case, False)])


def _reads(rank, world_size, root):
    """Two models in lockstep, one with overlapped gathers; after each step, read the parameters every way."""
    models, optimizers = [], []
    for overlap in (False, True):
        model = build_model("gpt2")
        models.append(model)
        optimizers.append(ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                           lr=1e-2, overlap_param_gather=overlap, verify_every=2))
    checks = []
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            model.train()
            optimizer.backward(model(**batch(rank, step, 0)).loss)
            optimizer.step()
            optimizer.zero_grad()
        assert optimizers[1]._pending_gathers or step == 1  # in flight (step 1 verifies: it finishes them)
        with torch.no_grad():  # an evaluation forward right after step()
            outputs = [model.eval()(**batch(rank, 99, 0)).logits for model in models]
        checks.append(torch.equal(*outputs))
    plain, overlapped = models
    optimizers[1].backward(overlapped.train()(**batch(rank, 3, 0)).loss)  # one more step, then a checkpoint
    optimizers[0].backward(plain.train()(**batch(rank, 3, 0)).loss)
    for optimizer in optimizers:
        optimizer.step()
    save_checkpoint(os.path.join(root, "overlapped"), optimizers[1], overlapped)
    exported = export_fp32_state_dict(os.path.join(root, "overlapped"))
    checks.append(all(torch.equal(exported[n], p.detach()) for n, p in plain.named_parameters()))
    optimizers[1].backward(overlapped(**batch(rank, 4, 0)).loss)
    optimizers[0].backward(plain(**batch(rank, 4, 0)).loss)
    for optimizer in optimizers:
        optimizer.step()
    optimizers[1].finish_param_gathers()  # a user's own read
    checks.append(all(torch.equal(a, b) for a, b in zip(plain.parameters(), overlapped.parameters())))
    return checks


def test_every_read_after_step_sees_the_new_parameters(tmp_path):
    for checks in run_distributed(2, _reads, str(tmp_path)):
        assert checks == [True] * len(checks) and len(checks) == 5
