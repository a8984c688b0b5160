"""A rank that dies or hangs mid-step stops the job in bounded time, and the job started again resumes it.

Jobs run tests/fault_training.py under torchrun (2 CPU ranks, gloo): a small plain-torch language model, stage 2,
a checkpoint after every step. Bounds: the hung rank's peers must stop within the collective timeout (3 s) plus
process start and teardown, so the whole job must end within HANG_JOB_LIMIT seconds (without the timeout it would
wait out the hung rank's 600 s sleep). The restarted job must end bitwise where an uninterrupted one does.
"""

import os
import re
import sys
import time

import pytest
import torch

import jobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "fault_training.py")
COLLECTIVE_TIMEOUT = 3.0
CHECKPOINT_TIMEOUT = 5.0  # save_checkpoint(timeout=...): the agreements around the checkpoint's I/O
HANG_JOB_LIMIT = 90.0


def torchrun(out, *flags, restarts=0, timeout=300):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", str(restarts), "--monitor-interval", "0.5", SCRIPT, str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    started = time.monotonic()
    completed = jobs.run(command, env, timeout)
    return completed, time.monotonic() - started


def test_killed_rank_restarts_from_the_last_checkpoint_and_matches(tmp_path):
    """Rank 1 is SIGKILLed mid-step 3: rank 0 fails, and the job, started again, resumes from step 2.

    The test starts the job again itself, as a scheduler or a user would: torchrun's in-job restarts
    (--max-restarts) re-rendezvous gloo, which on this 2-core machine intermittently fails with "connection
    refused" or hangs, with and without zeroimpl (seen in 2 of 6 tries), which is not what this tests."""
    interrupted, _ = torchrun(tmp_path / "killed", "--fault", "kill", "--fault-step", "3", timeout=120)
    assert interrupted.returncode != 0 and re.search(r"exitcode\s*:\s*-9", interrupted.stderr), interrupted.stderr[-4000:]
    resumed, _ = torchrun(tmp_path / "killed", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "rank 0: resumed from step-2" in resumed.stdout and "rank 1: resumed from step-2" in resumed.stdout
    clean, _ = torchrun(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-4000:]
    restarted = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    uninterrupted = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    assert restarted.keys() == uninterrupted.keys()
    assert all(torch.equal(restarted[n], uninterrupted[n]) for n in uninterrupted)


@pytest.mark.parametrize("fault, join, waiting_in", [("hang", None, "check all-reduce"),
                                                     ("hang", "plain", "Join notification"),
                                                     ("hang", "throw", "Join termination check"),
                                                     ("hang-save", None, "checkpoint agreement (preparing the checkpoint")])
def test_hung_rank_makes_the_others_fail_within_the_timeout(tmp_path, fault, join, waiting_in):
    """Rank 1 sleeps in step 3, after its backward (``hang``) or before the step's checkpoint (``hang-save``);
    rank 0's next collective (the step's check all-reduce; under ``Join``, the notification of torch's protocol
    that the step's check-in issues first, or with ``throw_on_early_termination`` the check that follows it; or
    the checkpoint's first agreement) gives up after 3 s (5 s:
    ``save_checkpoint(timeout=...)``) with a clear error naming it, and torchrun then stops rank 1 too: the job
    fails quickly instead of hanging."""
    failed, seconds = torchrun(tmp_path / "hung", "--fault", fault, "--fault-step", "3",
                               "--collective-timeout", str(COLLECTIVE_TIMEOUT),
                               "--checkpoint-timeout", str(CHECKPOINT_TIMEOUT), *(["--join", join] if join else []))
    assert failed.returncode != 0
    bound = COLLECTIVE_TIMEOUT if fault == "hang" else CHECKPOINT_TIMEOUT
    assert "CollectiveError" in failed.stderr and f"within its timeout of {bound} s" in failed.stderr
    assert waiting_in in failed.stderr, failed.stderr[-4000:]
    assert "Restart the job from the last checkpoint" in failed.stderr
    assert seconds < HANG_JOB_LIMIT, seconds
    # only whole checkpoints are published; a save cut short stays in its .partial folder, which loads
    # ignore and the next save of that step empties
    published = [name for name in os.listdir(tmp_path / "hung") if not name.endswith(".partial")]
    assert sorted(published) == ["step-1", "step-2"]
