"""Jobs of several processes (torchrun and its ranks) run from a test, none of which outlives it.

``subprocess.run(timeout=...)`` kills only the process it started, and torchrun starts each rank in a session of
its own: a torchrun agent killed either way leaves its ranks running (a hung one sleeping, the others waiting on
it), holding ports, cores and the job's output pipes while the rest of the suite runs. A job past its timeout is
killed here with every process it started, found by their parent links before any of them dies.
"""

from __future__ import annotations

import os
import signal
import subprocess

REAP_SECONDS = 30.0  # for the killed processes to be gone and their pipes closed


def start(command: list[str], env: dict, merge_output: bool = False) -> subprocess.Popen:
    """Start ``command`` with its output captured as text (stderr into stdout when ``merge_output``)."""
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, text=True)


def finish(job: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait up to ``timeout`` seconds for ``job`` to end and return what it printed; past that, kill it and every
    process it started and raise ``subprocess.TimeoutExpired`` with what they had printed."""
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = kill(job)
        raise subprocess.TimeoutExpired(job.args, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def kill(job: subprocess.Popen) -> tuple:
    """Kill ``job`` and its descendants if it is still running (its pid is its own until it is reaped); return
    what is left of its output."""
    if job.poll() is not None:
        return None, None
    for pid in [*_descendants(job.pid), job.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile
            pass
    return job.communicate(timeout=REAP_SECONDS)


def run(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, but a job past its timeout
    is killed with every process it started."""
    return finish(start(command, env), timeout)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])  # (the name may hold spaces)
        except OSError:  # gone
            continue
        children.setdefault(parent, []).append(int(entry))
    found, unvisited = [], [pid]
    while unvisited:
        below = children.get(unvisited.pop(), [])
        found += below
        unvisited += below
    return found
