"""Jobs of several processes (torchrun and its ranks) run from a test, none of which outlives it.

``subprocess.run(timeout=...)`` kills only the process it started: a torchrun agent killed that way leaves its
ranks running (a hung one sleeping, the others waiting on it), and they hold ports and cores while the rest of the
suite runs. Each job here runs in its own session, and a job past its timeout is killed whole.
"""

from __future__ import annotations

import os
import signal
import subprocess


def start(command: list[str], env: dict, merge_output: bool = False) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group), with its output captured as text
    (stderr into stdout when ``merge_output``)."""
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(job: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait up to ``timeout`` seconds for ``job`` to end and return what it printed; past that, kill its
    process group (the job and every process it started) and raise ``subprocess.TimeoutExpired``."""
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(job)
        raise
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def kill(job: subprocess.Popen) -> None:
    """Kill ``job``'s process group if ``job`` is still running (its id is the group's until it is reaped)."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()


def run(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, but a job past its
    timeout is killed whole."""
    return finish(start(command, env), timeout)
