"""The tests' process launcher: ``zeroimpl.integrations.launch.run_distributed`` (the comparison harness's),
with bounds that make a divergence between ranks fail in seconds, naming the collective it hung in; and
:func:`run_cases`, which runs many cases in one launch so that one case's exception fails that case only.

Every collective of a test's ranks is bounded by ``COLLECTIVE_TIMEOUT`` (the process group's timeout, which
zeroimpl's waits and gloo's own operations honour): a rank that skips a collective its peers run (a step
one rank skips, a verdict taken locally) makes the others raise after that long, with zeroimpl's
``CollectiveError`` naming the collective. ``DEADLINE`` bounds a whole launch, against hangs outside any
collective. The longest launch (test_optimizer_misuse's fixture, 39 cases) takes about 67 s alone on 2 cores, and about
90 s beside another module (120 s before the ranks stopped paying a garbage collection of the preloaded heap); under a third pytest worker it passed 180 s (the deadline was 180 s then), so the
deadline leaves room for a slower machine rather than fail a launch that is only slow.

Many cases, one launch (a module-scoped fixture)::

    def _all(rank, world_size):                       # in the ranks
        return run_cases({"parity": partial(_parity, rank), ("edited", "cpu"): partial(_edited, rank, "cpu")})

    @pytest.fixture(scope="module")
    def ranks():
        return run_distributed(2, _all)               # one run_cases dict per rank

    def test_optimizer_parity(ranks):
        for result in case_results(ranks, "parity"):  # AssertionError with the case's traceback if it raised
            ...
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import traceback
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.distributed as dist

from zeroimpl import comm
from zeroimpl.integrations import launch

COLLECTIVE_TIMEOUT = 30.0
DEADLINE = 600.0


def run_distributed(world_size: int, fn, *args, timeout: float = DEADLINE,
                    process_group_timeout: float = COLLECTIVE_TIMEOUT, **kwargs) -> list:
    """``launch.run_distributed`` with the tests' bounds (see the module docstring)."""
    return launch.run_distributed(world_size, fn, *args, timeout=timeout, process_group_timeout=process_group_timeout,
                                  **kwargs)


@contextlib.contextmanager
def issuing_collectives_at_one_rank():
    """Optimizers built inside run the backend's reduce-scatters and all-gathers at world size 1 too, where they
    would otherwise be copies (``zeroimpl.comm.issues_collectives``, asked at construction): so that a machine with
    one GPU runs the collective path (tests/test_cuda.py)."""
    original = comm.issues_collectives
    comm.issues_collectives = lambda world_size: True
    try:
        yield
    finally:
        comm.issues_collectives = original


def collectives_at_one_rank(rank: int, world_size: int, fn, *args):
    """``fn(rank, world_size, *args)`` under :func:`issuing_collectives_at_one_rank`: pass it to
    :func:`run_distributed` in ``fn``'s place, ``fn`` first among the arguments."""
    with issuing_collectives_at_one_rank():
        return fn(rank, world_size, *args)


@dataclass(frozen=True)
class CaseFailed:
    """What :func:`run_cases` records for a case that raised on this rank: its traceback."""

    name: Hashable
    rank: int
    traceback: str

    def __str__(self) -> str:
        return f"case {self.name!r} failed on rank {self.rank}:\n{self.traceback}"


def run_cases(cases: dict[Hashable, Callable[[], object]]) -> dict:
    """Run each case (a callable with no arguments) in order on this rank; return ``{name: its result}``,
    with a :class:`CaseFailed` (the formatted traceback) for a case that raised, so that the test of each
    case fails alone (:func:`case_result`, :func:`case_results`). Call it on every rank at the same point.

    Collectives must stay matched across ranks, and a failed case may leave them unmatched: one that raises
    on one rank only, part-way through its collectives, leaves its peers waiting in a collective until
    ``COLLECTIVE_TIMEOUT`` (they raise too), and then the ranks have issued different numbers of collectives
    on the default group, whose later collectives would pair up wrongly (gloo even closes its connections
    on a timeout). So after each case the ranks tell each other whether it raised, over a gloo group of
    run_cases' own that no case uses; if it raised on any rank, every rank replaces the default group by a
    fresh one (:func:`_rebuild_default_group`) before the next case, which then starts in step whatever the
    failed case left. What a failed case left in this process (its model, hooks, patched functions it did
    not restore) is not undone: a case must restore what it patches in a ``finally``.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    verdicts = _verdict_group() if world else None
    results, rebuilds = {}, 0
    for name, case in cases.items():
        try:
            results[name] = case()
            ok = True
        except Exception:  # noqa: BLE001 - reported by the case's own test
            results[name] = CaseFailed(name, rank, traceback.format_exc())
            ok = False
        if not world:
            continue
        flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([ok], dtype=torch.uint8), group=verdicts)
        failed = [r for r, flag in enumerate(flags) if not flag.item()]
        if not failed:
            continue
        rebuilds += 1
        try:
            gc.collect()  # the failed case's optimizers and their hooks go before the next case starts
            _rebuild_default_group(rebuilds)
            verdicts = _verdict_group()
        except Exception as error:
            raise RuntimeError(f"case {name!r} raised on rank(s) {failed}, and the default process group could "
                               "not be rebuilt after it; see that case's traceback in the results") from error
    return results


def _verdict_group():
    """A gloo group over every rank for run_cases' own flags, bounded by the launch's deadline (a peer may
    still be running its case)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=DEADLINE))


def _rebuild_default_group(generation: int) -> None:
    """Destroy every process group and make a new default group of the same backend, ranks and timeout,
    meeting through the old default group's store under a new prefix."""
    backend, rank, world_size = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    try:
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        timeout = dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT)
    store = dist.distributed_c10d._get_default_store()  # (private: the launcher's store, shared by the ranks)
    dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(f"run_cases/{generation}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def case_result(results: dict, name: Hashable):
    """This rank's result of case ``name`` (``results``: one rank's :func:`run_cases` dict); an AssertionError
    carrying the case's traceback if it raised."""
    __tracebackhide__ = True  # (pytest: show the test's line, not this one)
    found = results[name]
    if isinstance(found, CaseFailed):
        raise AssertionError(str(found))
    return found


def case_results(ranks: list[dict], name: Hashable) -> list:
    """Every rank's result of case ``name`` (``ranks``: what ``run_distributed`` returned, one :func:`run_cases`
    dict per rank); an AssertionError with the traceback of every rank where it raised."""
    __tracebackhide__ = True
    failed = [results[name] for results in ranks if isinstance(results[name], CaseFailed)]
    if failed:
        raise AssertionError("\n".join(map(str, failed)))
    return [results[name] for results in ranks]


__all__ = ["run_distributed", "run_cases", "case_result", "case_results", "CaseFailed", "COLLECTIVE_TIMEOUT",
           "DEADLINE"]
