"""benchmarks/network.py at its smallest: two simulated nodes (network namespaces joined by a tc-shaped veth pair,
one torchrun agent each, 2 ranks per node) train GPT-2 small with zeroimpl stage 2 for 3 steps.

* The bytes it reports across the link per step match what the ranks sent to the other node, counted by the
  collective counter at ``torch.distributed.isend``: with ``ZEROIMPL_COLLECTIVES=pairwise`` zeroimpl's
  reduce-scatter and all-gather are point-to-point exchanges whose peers the counter sees (by default the
  all-gather across nodes is gloo's own ring, whose bytes it cannot attribute): at least that, at most 3% more
  (measured 0.3-0.5%: TCP/IP headers once per GSO segment of up to 64 KB, ACKs, the step's 5-element all-reduce
  and the barriers that mark the step boundaries). The two readings come with no all-gather in flight
  (``harness.train_rank`` settles them): before, a warmup step's all-gather still crossing after the first
  reading added up to 3.5% at random (test_comparison's quiet-network test).
* Interrupted (SIGINT, as Ctrl-C) while its ranks run, it leaves no namespace and no process behind.

Skipped where namespaces cannot be made (not root, no iproute2, no CAP_NET_ADMIN), with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "network.py")
OVERHEAD_BOUND = 1.03


def _namespaces(run: subprocess.Popen) -> set[str]:
    """The network namespaces of ``run`` (named after its pid: benchmarks/network.py's Link.prefix), so that
    other runs on the machine at the same time do not count."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefix = f"zi{run.pid % 100000}n"
    return {line.split()[0] for line in listed.splitlines() if line.startswith(prefix)}


def _running(pid: str) -> bool:
    """Whether the process exists and is not a zombie (a killed rank whose parent died first waits to be reaped)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cannot_simulate() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs root and iproute2 (ip, tc)"
    probe = f"zeroimpl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


CANNOT_SIMULATE = _cannot_simulate()
pytestmark = pytest.mark.skipif(CANNOT_SIMULATE is not None, reason=str(CANNOT_SIMULATE))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_bytes_across_the_link_match_the_bytes_the_ranks_sent_to_the_other_node(tmp_path):
    run = subprocess.Popen([sys.executable, SCRIPT, "--sizes", "small", "--rates", "10gbit", "--only", "zeroimpl-2",
                            "--steps", "3", "--count-collectives", "--out", str(tmp_path)],
                           env={**ENV, "ZEROIMPL_COLLECTIVES": "pairwise"}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        output = run.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        run.terminate()  # SIGTERM: the script cleans up its namespaces and ranks, as on Ctrl-C
        output = run.communicate(timeout=60)[0]
    assert run.returncode == 0, output[-5000:]
    (cell,) = json.load(open(tmp_path / "network.json"))["cells"]
    counted, crossed = cell["counted_cross_node_bytes_per_step"], cell["link_bytes_per_step"]
    assert counted > 1e6, cell  # GPT-2 small: ~1.1M parameters, reduce-scattered and all-gathered in fp32
    assert counted <= crossed <= OVERHEAD_BOUND * counted, cell
    assert cell["median_step_seconds"] > 0 and cell["final_loss"] > 0
    assert (tmp_path / "network.md").read_text().count("| gpt2 small | 10gbit | zeroimpl-2 |") == 1
    assert not _namespaces(run)


def test_an_interrupted_run_leaves_no_namespace_and_no_rank_behind(tmp_path):
    # far more steps than the test waits for: the run must end by the interrupt, never on its own
    run = subprocess.Popen([sys.executable, SCRIPT, "--sizes", "small", "--rates", "1gbit", "--only", "ddp",
                            "--steps", "100000", "--out", str(tmp_path)], env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not _namespaces(run) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    made = _namespaces(run)
    assert made, "the run made no namespace"
    pids_inside: set[str] = set()
    while len(pids_inside) < 6 and time.monotonic() < deadline + 60 and run.poll() is None:  # 2 agents, 4 ranks
        time.sleep(0.2)
        pids_inside |= {pid for ns in made for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                                      text=True).stdout.split()}
    run.send_signal(signal.SIGINT)
    output = run.communicate(timeout=60)[0]
    assert run.returncode != 0, output[-3000:]
    assert not _namespaces(run), output[-3000:]
    assert pids_inside, "no process ran in the namespaces"
    alive = [pid for pid in pids_inside if _running(pid)]
    assert not alive, f"processes left behind: {alive}"
