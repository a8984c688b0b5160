"""The tests' process launcher: ``zeroimpl.integrations.launch.run_distributed`` (the comparison harness's),
with bounds that make a divergence between ranks fail in seconds, naming the collective it hung in.

Every collective of a test's ranks is bounded by ``COLLECTIVE_TIMEOUT`` (the process group's timeout, which
zeroimpl's waits and gloo's own operations honour): a rank that skips a collective its peers run (a step
one rank skips, a verdict taken locally) makes the others raise after that long, with zeroimpl's
``CollectiveError`` naming the collective. ``DEADLINE`` bounds a whole launch; the longest takes about 25 s.
"""

from zeroimpl.integrations import launch

COLLECTIVE_TIMEOUT = 30.0
DEADLINE = 180.0


def run_distributed(world_size: int, fn, *args, timeout: float = DEADLINE,
                    process_group_timeout: float = COLLECTIVE_TIMEOUT, **kwargs) -> list:
    """``launch.run_distributed`` with the tests' bounds (see the module docstring)."""
    return launch.run_distributed(world_size, fn, *args, timeout=timeout, process_group_timeout=process_group_timeout,
                                  **kwargs)


__all__ = ["run_distributed", "COLLECTIVE_TIMEOUT", "DEADLINE"]
