"""Writes tests/data/flat-lamb8bit/: a checkpoint of bitsandbytes' LAMB8bit saved by zeroimpl as it was before
commit 3d02466, which sharded LAMB/LARS in flat pieces quantized in blocks of 256 (so each rank's trust ratio was
its piece's; this checkpoint cuts the first weight, 97 x 131, between the ranks). test_optimizer_kinds_lowbit.py
loads it into today's whole-parameter stepping.

Run it with the old code first on the path (2 CPU ranks, gloo):

    git worktree add /tmp/zeroimpl-before-3d02466 3d02466^
    ZEROIMPL_ROOT=/tmp/zeroimpl-before-3d02466 python tests/data/make_flat_lamb8bit_checkpoint.py tests/data/flat-lamb8bit
"""

import os
import sys

sys.path.insert(0, os.environ["ZEROIMPL_ROOT"])

import torch  # noqa: E402

from zeroimpl.integrations.launch import run_distributed  # noqa: E402


def model() -> torch.nn.Module:
    """The checkpoint's model (test_optimizer_kinds_lowbit.py builds the same one)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(131, 97), torch.nn.Linear(97, 5))


def save(rank: int, world_size: int, directory: str) -> str:
    import bitsandbytes as bnb

    import zeroimpl
    from zeroimpl.checkpoint import save_checkpoint

    assert zeroimpl.__file__.startswith(os.environ["ZEROIMPL_ROOT"]), zeroimpl.__file__
    net = model()
    optimizer = zeroimpl.ShardedOptimizer(net.parameters(), bnb.optim.LAMB8bit, stage=2, lr=1e-3)
    for step in range(2):
        torch.manual_seed(10 * rank + step)
        net(torch.randn(4, 131)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(directory, optimizer, net)
    return zeroimpl.__file__


if __name__ == "__main__":
    print(run_distributed(2, save, os.path.abspath(sys.argv[1])))
