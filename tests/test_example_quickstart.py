"""The README's main job: ``examples/quickstart.py`` under torchrun on 2 CPU ranks (gloo), as the README's first
command runs it, made small (one layer, 64 wide, 10 steps) so that it runs in seconds.

It must exit cleanly, print a loss that falls over the steps (a fixed corpus the model memorises, lr 3e-3 after a
5-step warm-up: measured 6.2529 at step 0 and 6.0172 at step 9), and a memory line for each rank, taken before
the last step: stage 2 holds a gradient shard, stage 1 with offload holds its master weights on the host.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "quickstart.py")
SMALL = ("--layers", "1", "--width", "64", "--steps", "10")


def quickstart(*flags: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
               *SMALL, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    return completed.stdout


@pytest.mark.parametrize("flags, held", [((), r"device memory \(MiB\): .*gradient_shard"),
                                         (("--stage", "1", "--offload"), r"host memory \(MiB\): .*master_weights")])
def test_the_readme_main_job_trains_and_reports_each_ranks_memory(flags, held):
    printed = quickstart(*flags)
    losses = [float(loss) for loss in re.findall(r"^step +\d+ +loss ([\d.]+)", printed, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], printed
    for rank in (0, 1):
        assert re.search(rf"^rank {rank} {held}", printed, re.M), printed
    assert "10 steps in" in printed
