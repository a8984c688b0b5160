"""``overlap_param_gather=True``: each bucket's parameter all-gather stays in flight after ``step()`` and is
waited for just before the forward of the first module holding one of its parameters. Results must be
bitwise those of the default mode (the same collectives, waited for later), and every path that reads the
parameters in between must see the new values: a forward (also under ``no_grad`` / ``eval``), checkpoints,
``verify_ranks_agree``, and a user's read after ``finish_param_gathers()``.
"""

import io
import os
import time

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
        assert optimizers[1].param_gathers_in_flight or step == 1  # in flight (step 1 verifies: it finishes them)
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


def _clone(params):
    return [p.detach().clone() for p in params]


def _ema(params):
    averages = [torch.zeros_like(p, requires_grad=False) for p in params]
    with torch.no_grad():
        for average, p in zip(averages, params):
            average.mul_(0.9).add_(p, alpha=0.1)
    return averages


def _clamp(params):  # a write: a projection after step() (weight clipping), read back later
    with torch.no_grad():
        for p in params:
            p.data.clamp_(-0.05, 0.05)
    return None


def _saved(params):
    buffer = io.BytesIO()
    torch.save(list(params), buffer)
    buffer.seek(0)
    return torch.load(buffer)


USER_READS = {
    "clone": _clone,
    ".data": lambda params: [p.data.clone() for p in params],
    "tolist": lambda params: [torch.tensor(p.tolist()) for p in params],
    "parameters_to_vector": lambda params: [torch.nn.utils.parameters_to_vector(params)],
    "EMA update": _ema,
    "torch.save": _saved,
    "clamp_ after step": _clamp,
}


def _user_reads(rank, world_size):
    """After each step, a read or write of the parameters in user code, with no call to finish_param_gathers.
    Rank 1 enters step() late, so rank 0's all-gathers are surely still in flight when it reads."""
    models, optimizers = [], []
    for overlap in (False, True):
        model = build_model("gpt2")
        models.append(model)
        optimizers.append(ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                           lr=1e-2, overlap_param_gather=overlap))
    results = {}
    for step, (name, read) in enumerate(USER_READS.items()):
        for model, optimizer in zip(models, optimizers):
            optimizer.backward(model(**batch(rank, step, 0)).loss)
            if rank == 1 and optimizer.overlap_param_gather:
                time.sleep(0.3)
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            assert optimizers[1].param_gathers_in_flight, "rank 0's all-gathers should still be in flight"
        plain, overlapped = (read(list(model.parameters())) for model in models)
        if plain is None:  # a write: compare the parameters once the gathers are done
            optimizers[1].finish_param_gathers()
            plain, overlapped = (list(model.parameters()) for model in models)
        results[name] = all(torch.equal(a, b) for a, b in zip(plain, overlapped))
    for model, optimizer in zip(models, optimizers):  # leave the last gathers in flight: teardown must not hang
        optimizer.backward(model(**batch(rank, 99, 0)).loss)
        if rank == 1 and optimizer.overlap_param_gather:
            time.sleep(0.3)
        optimizer.step()
    return results


def test_a_users_own_read_or_write_after_step_sees_the_new_parameters():
    for results in run_distributed(2, _user_reads):
        assert results == {name: True for name in USER_READS}
