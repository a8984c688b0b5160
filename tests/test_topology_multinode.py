"""A real two-node job on this machine: two torchrun agents (``--nnodes 2``, 2 ranks each, c10d rendezvous on
localhost), as two machines would run it, train tests/fault_training.py (a small plain-torch language model,
stage 2, a checkpoint after every step) with hybrid sharding on a 2 x 2 mesh (each node one shard group, the nodes
replicas), and resume from its checkpoint of step 3: on the two nodes again (bitwise equal to an uninterrupted run:
same mesh, same summation order), and on one node of 2 ranks, a flat world (within PARAM_ATOL = 1e-4, the parity
tolerance: every rank trains on its slice of one global batch, so the averaged gradient is the same up to
summation order).
"""

import os
import re
import shutil
import socket
import sys

import torch

import jobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "fault_training.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
PARAM_ATOL = 1e-4
MESH = ("--mesh", "2", "--global-batch")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def two_nodes(out, steps: int) -> list[str]:
    """Run the job as two nodes of 2 ranks each (one torchrun agent per node); return each node's output."""
    endpoint, run_id = f"localhost:{free_port()}", f"zeroimpl-test-{os.getpid()}-{steps}-{os.path.basename(out)}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, SCRIPT, str(out),
               "--steps", str(steps), *MESH]
    # the same command on both nodes: the c10d rendezvous numbers the nodes (torchrun ignores --node_rank there)
    agents = [jobs.start(command, ENV, merge_output=True) for _ in range(2)]
    try:
        finished = [jobs.finish(agent, timeout=300) for agent in agents]
    finally:
        for agent in agents:  # the other node, when one timed out
            jobs.kill(agent)
    for done in finished:
        assert done.returncode == 0, done.stdout[-4000:]
    return [done.stdout for done in finished]


def one_node(out, steps: int, nproc: int) -> str:
    completed = jobs.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                          SCRIPT, str(out), "--steps", str(steps), "--global-batch"], ENV, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def final(out) -> dict:
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def test_two_nodes_train_checkpoint_and_resume_on_the_mesh_or_a_flat_world(tmp_path):
    clean = two_nodes(tmp_path / "clean", steps=5)
    # (the two ranks of one node share its output, and their lines may interleave)
    placed = [re.findall(r"rank (\d) of 4 on node (\d)", output) for output in clean]
    assert sorted(rank for found in placed for rank, _ in found) == ["0", "1", "2", "3"]
    assert sorted({node for found in placed for _, node in found}) == ["0", "1"]
    assert all(len(found) == 2 and len({node for _, node in found}) == 1 for found in placed)  # 2 ranks a node

    assert sorted(os.listdir(tmp_path / "clean")) == ["final.pt", *(f"step-{step}" for step in range(1, 6))]
    assert sorted(n for n in os.listdir(tmp_path / "clean" / "step-3") if n.startswith("rank-")) == [
        "rank-00000.pt", "rank-00001.pt"]  # one copy of each shard of the 2-rank shard group
    # the job stopped after step 3: its newest checkpoint is the clean run's step 3 (a run of 3 steps writes it
    # bit for bit: the same ranks, batches and summation order)
    for resumed_in in ("job", "flat"):
        shutil.copytree(tmp_path / "clean" / "step-3", tmp_path / resumed_in / "step-3")

    resumed = two_nodes(tmp_path / "job", steps=5)
    assert sum(output.count("resumed from step-3") for output in resumed) == 4
    flat = one_node(tmp_path / "flat", steps=5, nproc=2)
    assert flat.count("resumed from step-3") == 2

    expected = final(tmp_path / "clean")
    on_the_mesh, on_a_flat_world = final(tmp_path / "job"), final(tmp_path / "flat")
    assert all(torch.equal(on_the_mesh[n], expected[n]) for n in expected)
    assert max((on_a_flat_world[n] - expected[n]).abs().max().item() for n in expected) <= PARAM_ATOL
