"""In-process unit tests of the pure parts: the loss scaler, the reshard plan, the step's agreement encoding,
and the order buckets are launched in. No process group: each runs in microseconds, and a failure names
the rule it breaks."""

import random

import pytest
import torch

from zeroimpl.checkpoint.reshard import plan
from zeroimpl.grad_sync import complete_through
from zeroimpl.layout import ParamSpec, build_layout, overlap
from zeroimpl.precision import DynamicLossScaler, LossScaleConfig
from zeroimpl.step_checks import decode_checks, encode_checks


# -- loss scaler -------------------------------------------------------------------------------------
def scaler(**config) -> DynamicLossScaler:
    return DynamicLossScaler(LossScaleConfig(**{"initial_scale": 1024.0, "growth_interval": 2, **config}))


def test_hysteresis_delays_the_backoff_until_that_many_overflows():
    s = scaler(hysteresis=3)
    for expected in (1024.0, 1024.0, 512.0, 256.0):  # once exhausted, every further overflow backs off
        s.update(found_overflow=True)
        assert s.scale == expected
    assert s.skipped_steps == 4


def test_growth_restores_the_hysteresis():
    """overflow -> growth -> overflow: the overflow after a growth is absorbed again (as DeepSpeed does)."""
    s = scaler(hysteresis=2)
    s.update(found_overflow=True)  # absorbed: 1 left
    s.update(found_overflow=False)
    s.update(found_overflow=False)  # growth_interval clean steps: grows, hysteresis back to 2
    assert s.scale == 2048.0
    s.update(found_overflow=True)
    assert s.scale == 2048.0, "the hysteresis was not restored by the growth"
    s.update(found_overflow=True)
    assert s.scale == 1024.0


def test_an_overflow_restarts_the_growth_interval():
    s = scaler(hysteresis=1, growth_interval=3)
    s.update(False), s.update(False), s.update(True), s.update(False), s.update(False)
    assert s.scale == 512.0  # backed off; two clean steps since are not yet an interval
    s.update(False)
    assert s.scale == 1024.0


def test_the_scale_never_drops_below_min_scale():
    s = scaler(hysteresis=1, initial_scale=4.0, min_scale=2.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0


def test_state_round_trip_keeps_the_remaining_hysteresis():
    """A scaler restored after one absorbed overflow backs off at the next one, as the original would."""
    original = scaler(hysteresis=2)
    original.update(found_overflow=True)
    original.update(found_overflow=False)  # one clean step of the growth interval, too
    restored = scaler(hysteresis=2)
    restored.load_state_dict(original.state_dict())
    for s in (original, restored):
        s.update(found_overflow=True)
    assert restored.scale == original.scale == 512.0
    assert restored.state_dict() == original.state_dict()


# -- reshard plan ------------------------------------------------------------------------------------
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


def test_overlap_of_half_open_ranges():
    assert overlap(0, 10, 5, 20) == (5, 10)
    assert overlap(5, 20, 0, 10) == (5, 10)
    assert overlap(0, 5, 5, 10) is None  # touching is not overlapping
    assert overlap(3, 4, 0, 100) == (3, 4)


# -- the step's agreement encoding -------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_checks_agree_iff_every_rank_ran_the_same_backward_passes(seed):
    """Each rank encodes (norm term, backward passes, lacking a gradient); the SUM (2-norm) or MAX (inf-norm)
    all-reduce is simulated, and every rank must decode the same, right verdict."""
    rng = random.Random(seed)
    world, maximum = rng.randint(1, 6), rng.random() < 0.5
    passes = [rng.choice([1, 2, 3]) if rng.random() < 0.3 else 2 for _ in range(world)]
    norms = [rng.choice([0.5, 2.0, float("inf"), float("nan")]) if rng.random() < 0.2 else 1.5 for _ in range(world)]
    lacking = [rng.random() < 0.2 for _ in range(world)]
    encoded = torch.stack([encode_checks(torch.tensor(n), float(p), l, maximum)
                           for n, p, l in zip(norms, passes, lacking)])
    reduced = encoded.max(dim=0).values if maximum else encoded.sum(dim=0)
    suspect, same_passes, some_lack = decode_checks(reduced.tolist(), maximum, world)
    assert same_passes == (len(set(passes)) == 1)
    assert suspect == any(n != n or n in (float("inf"),) for n in norms)
    assert some_lack == any(lacking)
    finite = [n for n in norms if n == n and n != float("inf")]
    if not suspect:
        assert reduced[1].item() == pytest.approx(max(finite) if maximum else sum(finite))


@pytest.mark.parametrize("world, passes", [(1024, 129), (2048, 91), (8, 4097), (65536, 3)])
def test_equal_backward_pass_counts_agree_at_large_world_sizes(world, passes):
    """Every rank ran the same (odd) number of backward passes: a ring's running SUM of the encoded checks,
    rank after rank, must still say so (fp32 sums of squared counts would round past 2**24)."""
    encoded = encode_checks(torch.tensor(1.5), float(passes), False, maximum=False)
    reduced = torch.zeros_like(encoded)
    for _ in range(world):
        reduced += encoded
    assert decode_checks(reduced.tolist(), False, world)[1]


# -- bucket launch order -----------------------------------------------------------------------------
class _Bucket:
    def __init__(self, param_indices):
        self.param_indices = param_indices


def _order(sizes_by_bucket):
    buckets = [_Bucket(params) for params in sizes_by_bucket]
    return buckets, [set() for _ in buckets]


def test_buckets_launch_in_index_order_whatever_order_gradients_arrive():
    """Every rank must issue the same collectives in the same order: a bucket starts only when it is complete
    and every bucket before it has started."""
    buckets, arrived = _order([[0, 1], [2], [3, 4, 5]])  # parameter indices per bucket
    for bucket, param in ((1, 2), (0, 0), (2, 5)):
        arrived[bucket].add(param)
        assert complete_through(arrived, buckets, 0) == 0  # bucket 1 complete, but bucket 0 is not
    arrived[0].add(1)
    assert complete_through(arrived, buckets, 0) == 2  # bucket 0 completes: 0, then the waiting 1
    arrived[2].add(3)
    assert complete_through(arrived, buckets, 2) == 2
    arrived[2].add(4)
    assert complete_through(arrived, buckets, 2) == 3


def test_a_bucket_without_every_gradient_waits_for_the_end_of_the_round():
    buckets, arrived = _order([[0], [1, 2], [3]])
    arrived[2].add(3)  # bucket 0 got no gradient on this rank: nothing starts before the end of the round
    assert complete_through(arrived, buckets, 0) == 0
    arrived[0].add(0)
    assert complete_through(arrived, buckets, 0) == 1  # bucket 1 still lacks parameter 2

