"""A real two-node job on this machine: two torchrun agents (``--nnodes 2``, 2 ranks each, c10d rendezvous on
localhost), as two machines would run it, train tests/fault_training.py (tiny GPT-2, stage 2, a checkpoint
after every step), stop after step 3, and resume -- on the two nodes again and on one node of 4 ranks. Both
resumed runs must end bitwise where an uninterrupted two-node run ends (same world size, so the same data
per rank and the same summation order).
"""

import os
import shutil
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "fault_training.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def two_nodes(out, steps: int) -> list[str]:
    """Run the job as two nodes of 2 ranks each (one torchrun agent per node); return each node's output."""
    endpoint, run_id = f"localhost:{free_port()}", f"zeroimpl-test-{os.getpid()}-{steps}-{os.path.basename(out)}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, SCRIPT, str(out),
               "--steps", str(steps)]
    # the same command on both nodes: the c10d rendezvous numbers the nodes (torchrun ignores --node_rank there)
    agents = [subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    return outputs


def one_node(out, steps: int, nproc: int) -> str:
    completed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(nproc), SCRIPT, str(out), "--steps", str(steps)],
                               env=ENV, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def final(out) -> dict:
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def test_two_nodes_train_checkpoint_and_resume_on_two_nodes_or_one(tmp_path):
    clean = two_nodes(tmp_path / "clean", steps=5)
    nodes = {line.split(" on node ")[1] for output in clean for line in output.splitlines() if " on node " in line}
    ranks = sorted(line.split(" of ")[0] for output in clean for line in output.splitlines()
                   if " of 4 on node " in line)
    assert nodes == {"0", "1"} and ranks == [f"rank {r}" for r in range(4)]  # 4 ranks, 2 per node

    two_nodes(tmp_path / "job", steps=3)
    assert sorted(os.listdir(tmp_path / "job")) == ["final.pt", "step-1", "step-2", "step-3"]
    os.makedirs(tmp_path / "flat")
    shutil.copytree(tmp_path / "job" / "step-3", tmp_path / "flat" / "step-3")

    resumed = two_nodes(tmp_path / "job", steps=5)
    assert sum(output.count("resumed from step-3") for output in resumed) == 4
    flat = one_node(tmp_path / "flat", steps=5, nproc=4)
    assert flat.count("resumed from step-3") == 4

    expected = final(tmp_path / "clean")
    for out in ("job", "flat"):
        got = final(tmp_path / out)
        assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected), out
