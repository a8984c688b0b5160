"""The reshard plan (zeroimpl.checkpoint.format.plan), in process: every piece of a new layout is filled from the
saved pieces exactly once, on random layouts. Checkpoints saved and loaded across world sizes: test_checkpoint.py."""

import random

import pytest
import torch

from zeroimpl.checkpoint.format import plan
from zeroimpl.layout import ParamSpec, build_layout


def random_layout(rng: random.Random, numels: list[int]):
    specs = [ParamSpec(0 if i < len(numels) // 2 else 1, "torch.float32", n) for i, n in enumerate(numels)]
    return build_layout(specs, rng.randint(1, 5), rng.choice([8, 64, 1000]), rng.choice([1, 4, 8]))


@pytest.mark.parametrize("seed", range(30))
def test_plan_fills_every_new_piece_from_the_saved_files_exactly_once(seed):
    """Saved rank files hold each piece's elements (here: their global element numbers); applying the plan
    must give every new rank exactly the elements of its pieces, each written once, padding untouched."""
    rng = random.Random(seed)
    numels = [rng.randint(1, 300) for _ in range(rng.randint(1, 8))]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    saved, new = random_layout(rng, numels), random_layout(rng, numels)
    files = {r: torch.cat([torch.arange(starts[p.param_index] + p.param_start, starts[p.param_index] + p.param_end)
                           for p in saved.pieces(r)] or [torch.zeros(0, dtype=torch.int64)])
             for r in range(saved.world_size)}
    for rank in range(new.world_size):
        shards = [torch.full((b.shard_numel,), -1, dtype=torch.int64) for b in new.buckets]
        writes = [torch.zeros(b.shard_numel, dtype=torch.int64) for b in new.buckets]
        for c in plan(saved, new, rank):
            shards[c.target_bucket][c.target_offset:c.target_offset + c.length] = \
                files[c.source_rank][c.source_offset:c.source_offset + c.length]
            writes[c.target_bucket][c.target_offset:c.target_offset + c.length] += 1
        expected = [torch.full((b.shard_numel,), -1, dtype=torch.int64) for b in new.buckets]
        for p in new.pieces(rank):
            expected[p.bucket_index][p.shard_offset:p.shard_offset + p.length] = torch.arange(
                starts[p.param_index] + p.param_start, starts[p.param_index] + p.param_end)
        for got, want, count in zip(shards, expected, writes):
            assert torch.equal(got, want)
            assert torch.equal(count, (want >= 0).long())  # each element once, padding never