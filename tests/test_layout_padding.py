"""Bucket padding is zero wherever it lives: parameter buffers, master shards, reduction buffers and the
gradient shards they reduce into. Padding belongs to no parameter; garbage there would enter the gradient
norm (NaN in clipping and in the NaN/Inf check) of the rank whose shard holds it.

World size 3 with buckets whose sizes are not multiples of 3 * alignment, so ranks hold padding. Before
each backward the allocator's free lists are filled with NaN blocks of every bucket's size, so that a
buffer not zeroed by construction would (on glibc, which reuses small freed blocks as they are) start out
as NaN instead of as the zeros fresh memory happens to hold (the same before the optimizer is built).
"""

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer


def _poison_allocator(sizes) -> None:
    for size in sizes:
        blocks = [torch.full((size,), float("nan")) for _ in range(4)]
        del blocks


def _padding_of(optimizer, rank, tensors_by_bucket) -> list[torch.Tensor]:
    """The padding elements inside this rank's shard of each bucket, from per-bucket shard tensors."""
    found = []
    for bucket, tensor in zip(optimizer.layout.buckets, tensors_by_bucket):
        start, end = bucket.shard_range(rank)
        if tensor is not None and bucket.numel < end:
            found.append(tensor[max(bucket.numel, start) - start:].detach().float())
    return found


def _check_padding(rank, world_size, stage, offload):
    model = build_model("gpt2")
    _poison_allocator([3000 + 3 * 8 * k for k in range(4)])  # sizes around the buckets' (at most 3000 + 23)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, offload=offload,
                                 bucket_numel=3000, lr=1e-2)
    storages = optimizer.storages
    observed = {"param buffers": [s.param_buffer[s.bucket.numel:] for s in storages]}
    for step in range(2):
        _poison_allocator([bucket.padded_numel for bucket in optimizer.layout.buckets])
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        _poison_allocator([bucket.padded_numel for bucket in optimizer.layout.buckets])  # stage 1 reduces now
        nonfinite = optimizer.found_nonfinite()  # reduces: the gradient shards now hold this step's sums
        observed[f"gradient shards, step {step}"] = _padding_of(optimizer, rank, optimizer.gradients.ready())
        observed[f"nonfinite, step {step}"] = [torch.tensor(float(nonfinite))]
        optimizer.step()
        optimizer.zero_grad()
        observed[f"masters, step {step}"] = _padding_of(optimizer, rank, [s.master for s in storages])
        observed[f"param buffers, step {step}"] = [s.param_buffer[s.bucket.numel:] for s in storages]
    padded = sum(b.padded_numel - b.numel for b in optimizer.layout.buckets)
    return {"padded": padded, "observed": {k: [t.clone() for t in v] for k, v in observed.items()}}


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
def test_padding_is_zero_everywhere(stage, offload):
    for rank, result in enumerate(run_distributed(3, _check_padding, stage, offload)):
        assert result["padded"] > 0  # the layout has padding to check
        for where, tensors in result["observed"].items():
            for tensor in tensors:
                assert torch.equal(tensor, torch.zeros_like(tensor)), f"rank {rank}, {where}: {tensor}"
