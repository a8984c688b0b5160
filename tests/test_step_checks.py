"""The step's checks (zeroimpl.step_checks), in process: the agreement all-reduce's encoding and the loss-scaling
misuse rule. The checks in a running step: test_step_checks_nonfinite.py and test_optimizer_misuse.py."""

import random

import pytest
import torch

from zeroimpl.step_checks import decode_checks, encode_checks, loss_scaling_misuse


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


def test_loss_scaling_refuses_an_unscaled_loss_and_a_backward_after_unscaling():
    assert "optimizer.backward(loss)" in loss_scaling_misuse(loss_scaled=False, unscaled=False)
    assert "between clip_grad_norm_" in loss_scaling_misuse(loss_scaled=True, unscaled=True)
    assert loss_scaling_misuse(loss_scaled=True, unscaled=False) is None