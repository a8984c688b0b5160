"""``quantize_param_gather=True``: the parameter all-gather in int8 with a scale per block of 256
(zeroimpl/quantized_gather.py), on real gloo ranks.

* The codec: every element within half a quantization step of its block (absmax / 254), zero blocks exact,
  a partial last block, the payload's size.
* Training (GPT-2 tiny, AdamW, stage 2, clipped, 6 steps; 2 ranks, and 3 where shard boundaries fall
  elsewhere; a bf16 model at 2): every
  rank holds bit-identical parameters after each step (``verify_ranks_agree``), and each rank's shard of them is
  exactly the dequantized payload of its master, so the quantization error never compounds: the master is
  stepped exact. Each step's loss stays within QUANTIZED_LOSS_RTOL of the same run unquantized (measured at
  most 1.5e-3 at 2 ranks, 3.0e-3 at 3). The parameters' relative L2 distance to that run is nonzero and within
  QUANTIZED_REL_L2 (measured 3.8e-2 and 4.2e-2: AdamW at lr 1e-2 moves an element with a near-zero gradient
  by about lr whichever its sign, so any perturbation -- quantization here -- spreads to that size within a
  few steps).
* The parameter all-gather moves (1 + 4/256) / 4 of fp32's bytes (the collective counter at ``isend``).
* With CPU offload (unfused step, as without offload) the run is bitwise the device run; a checkpoint saved
  at step 3 resumes bitwise to the uninterrupted run (the exact masters are saved, not the parameters);
  ``estimate_memory`` counts the fp32 master it adds for fp32 models, exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups, relative_l2
from zeroimpl import CPUOffload, ShardedOptimizer, estimate_memory, quantized_gather
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint
from zeroimpl.integrations.collectives import CollectiveCounter

QUANTIZED_LOSS_RTOL = 5e-3
QUANTIZED_REL_L2 = 0.1
STEPS = 6


@pytest.mark.parametrize("numel", [4, 256, 264, 1000])
def test_every_element_is_within_half_a_step_of_its_block(numel):
    torch.manual_seed(numel)
    shards = [torch.randn(numel) * 10 ** rank for rank in range(3)]
    shards[1][:min(numel, 256)] = 0.0  # a block of zeros stays exactly zero
    gathered = torch.cat([quantized_gather.encode(shard) for shard in shards])
    assert gathered.numel() == 3 * quantized_gather.payload_bytes(numel) == 3 * (numel + 4 * -(-numel // 256))
    out = torch.empty(3 * numel, dtype=torch.float32)
    quantized_gather.decode(gathered, 3, out)
    for shard, values in zip(shards, out.view(3, numel)):
        for start in range(0, numel, 256):
            block, decoded = shard[start:start + 256], values[start:start + 256]
            assert (decoded - block).abs().max() <= block.abs().max() / 254 * (1 + 1e-6)
    assert torch.equal(out[numel:numel + min(numel, 256)], torch.zeros(min(numel, 256)))


def test_a_shard_that_is_not_a_multiple_of_four_is_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantized_gather.encode(torch.ones(6))


def _train(rank, world_size, quantize, offload=False, checkpoint=None, resume=None, dtype=torch.float32):
    """GPT-2 tiny, stage 2, clipped to 1.0: the losses, the final parameters, whether each rank's parameter shard
    was its dequantized master after every step, and the bytes the parameter all-gathers sent per step."""
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                 quantize_param_gather=quantize, verify_every=1,
                                 offload=CPUOffload(fused_step=False) if offload else None)
    first = 0
    if resume is not None:
        load_checkpoint(resume, optimizer, model)
        first = 3
    losses, exact, sent = [], True, []
    for step in range(first, STEPS):
        loss = model(**batch(rank, step, 0)).loss
        losses.append(loss.item())
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)
        counter = CollectiveCounter().install()
        optimizer.step()
        optimizer.finish_param_gathers()
        counter.uninstall()
        sent.append(sum(c.numel * c.dtype.itemsize for c in counter.take() if c.name == "isend"))
        for storage in optimizer.storages:
            dequantized = torch.empty_like(storage.shard)
            quantized_gather.decode(quantized_gather.encode(storage.master), 1, dequantized)
            exact &= torch.equal(storage.shard, dequantized) if quantize else torch.equal(storage.shard,
                                                                                         storage.master)
        optimizer.zero_grad()
        if checkpoint is not None and step == 2:
            save_checkpoint(checkpoint, optimizer, model)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "exact": exact, "sent": sent}


def _runs(rank, world_size, directory):
    runs = {"plain": _train(rank, world_size, False),
            "quantized": _train(rank, world_size, True, checkpoint=os.path.join(directory, "step-3"))}
    if world_size == 2:
        runs["offload"] = _train(rank, world_size, True, offload=True)
        runs["resumed"] = _train(rank, world_size, True, resume=os.path.join(directory, "step-3"))
        runs["bf16"] = _train(rank, world_size, True, dtype=torch.bfloat16)
    return runs


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, tmp_path_factory):
    return request.param, run_distributed(request.param, _runs, str(tmp_path_factory.mktemp("quantized")))


def test_ranks_agree_and_the_parameters_are_the_dequantized_masters(runs):
    world_size, by_rank = runs
    kinds = ("quantized", "bf16") if world_size == 2 else ("quantized",)
    for kind in kinds:
        for rank_runs in by_rank:
            assert rank_runs[kind]["exact"] and rank_runs["plain"]["exact"], kind
        first = by_rank[0][kind]["params"]
        for rank_runs in by_rank[1:]:  # (verify_every=1 also compared them after every step)
            assert all(torch.equal(first[name], value) for name, value in rank_runs[kind]["params"].items())


def test_training_tracks_the_unquantized_run(runs):
    _, by_rank = runs
    for rank_runs in by_rank:
        plain, quantized = rank_runs["plain"], rank_runs["quantized"]
        assert plain["losses"][0] == quantized["losses"][0]  # the same model until the first gather
        for a, b in zip(plain["losses"], quantized["losses"]):
            assert abs(a - b) <= QUANTIZED_LOSS_RTOL * abs(a)
        distance = relative_l2(quantized["params"], plain["params"])
        assert 0 < distance <= QUANTIZED_REL_L2  # it did quantize


def test_the_parameter_gather_sends_a_quarter_of_the_bytes(runs):
    world_size, by_rank = runs
    for rank_runs in by_rank:
        for plain, quantized in zip(rank_runs["plain"]["sent"], rank_runs["quantized"]["sent"]):
            assert quantized / plain == pytest.approx((1 + 4 / 256) / 4, rel=0.02), (plain, quantized)


def test_offload_and_resuming_are_bitwise(runs):
    world_size, by_rank = runs
    if world_size != 2:
        pytest.skip("run at world size 2")
    for rank_runs in by_rank:
        quantized = rank_runs["quantized"]
        for other in (rank_runs["offload"], rank_runs["resumed"]):
            assert quantized["losses"][-len(other["losses"]):] == other["losses"]
            assert all(torch.equal(quantized["params"][n], v) for n, v in other["params"].items())


def _estimated_and_measured(rank, world_size):
    model = build_model("gpt2")
    groups = param_groups(model)
    estimated = estimate_memory(groups, world_size, 2, rank=rank, bucket_numel=4096, quantize_param_gather=True)
    optimizer = ShardedOptimizer(groups, torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                 quantize_param_gather=True)
    for step in range(2):
        optimizer.zero_grad()
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        measured = optimizer.memory_report()
        optimizer.step()
    return estimated.as_dict(), measured.as_dict()


def test_the_estimate_counts_the_master_it_adds():
    for estimated, measured in run_distributed(2, _estimated_and_measured):
        assert estimated == measured and measured["device"]["master_weights"] > 0
