"""Run implementations on the same model, data and optimizer settings, each in its own set of processes.

For every implementation the harness spawns ``world_size`` fresh ranks (gloo on the CPU, NCCL on GPUs),
builds the model with the same seed, trains ``steps`` optimizer steps on the same per-rank micro-batches,
and records per rank: the loss of every micro-batch, the step times, the model-state bytes by kind and the
peak memory. Rank 0 writes the final full parameters to ``workdir`` for the correctness verdict.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..adapters import Implementation, TrainSettings
from ..collectives import CollectiveCounter
from ..launch import run_distributed
from ..models import batch, build_model
from .measure import PeakMemory, model_state_bytes


@dataclass(frozen=True)
class Workload:
    """What every implementation is run on."""

    family: str = "gpt2"
    size: str = "tiny"
    world_size: int = 2
    steps: int = 4
    warmup_steps: int = 1  # not timed
    settings: TrainSettings = field(default_factory=TrainSettings)
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    count_collectives: bool = False  # record every timed step's collectives (slows the run: not for timing)

    def micro_batches(self, rank: int, step: int) -> list[dict]:
        return [batch(self.family, self.size, rank, step, micro, self.settings.micro_batch_size)
                for micro in range(self.settings.accum)]


@dataclass
class RankResult:
    losses: list[float]  # every micro-batch, in order
    step_seconds: list[float]  # every timed step (forward + backward + step)
    model_state: dict[str, int]  # bytes by kind at the larger of: after the last backward, after the last step
    peak_bytes: int  # peak memory past start-up (see measure.PeakMemory)
    tokens_per_step: int
    parameter_checksum: str  # SHA-256 of this rank's final full parameters: equal on every rank if in sync
    # per timed step: (name, numel, dtype name, peer: the global rank an isend / irecv addresses, else None)
    collectives: list[list[tuple]] = field(default_factory=list)


@dataclass
class RunResult:
    implementation: str
    stage: int
    offload: bool
    ranks: list[RankResult] = field(default_factory=list)
    parameters_path: Optional[str] = None  # rank 0's final full parameters (torch.save of a dict), in workdir
    skipped: Optional[str] = None  # why it did not run (not installed), with the fix
    failed: Optional[str] = None  # the error, when it ran and failed

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(t for r in self.ranks for t in r.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        return sum(r.tokens_per_step for r in self.ranks) / self.median_step_seconds

    @property
    def model_state(self) -> dict[str, int]:
        """The largest rank's model-state bytes by kind (ranks differ by at most padding)."""
        return max((r.model_state for r in self.ranks), key=lambda m: m["total"])

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_rank(rank: int, world_size: int, implementation: Implementation, workload: Workload,
               parameters_path: str, step_boundary: Optional[Callable[[int], None]] = None) -> RankResult:
    """Train on this rank of an initialised process group (one of ``run_implementation``'s processes, or a
    torchrun worker of benchmarks/network.py); rank 0 saves the final full parameters to ``parameters_path``.

    ``step_boundary(k)``, if given, runs on every rank right after the barrier that starts step ``k``, and with
    ``k = workload.steps`` behind one more barrier after the last step, before anything else communicates
    (benchmarks/network.py reads the link's byte counters there). The two calls that bound the timed steps
    (``k = warmup_steps`` and ``k = steps``) come with the link quiet: every rank first waits for what its
    previous step left in flight (:meth:`Runner.settle`; zeroimpl's parameter all-gathers), so the bytes between
    them are exactly the timed steps'. The last timed step's time includes that wait; the first's does not
    include the warmup step's."""
    device = torch.device(f"cuda:{rank}" if workload.device == "cuda" else "cpu")
    for module in ("transformers", *implementation.modules):
        importlib.import_module(module)  # imports are start-up, not training: before the peak is reset
    counter = CollectiveCounter().install() if workload.count_collectives else None
    memory = PeakMemory(device)
    memory.start()
    with device:  # initialised where it trains: on a GPU, seconds instead of a minute of CPU at 1B parameters
        model = build_model(workload.family, workload.size).to(device)
    runner = implementation.build(model, workload.settings, device)
    if counter is not None:
        runner.expose_collectives()
    losses, times, collectives = [], [], []
    after_backward = None
    for step in range(workload.steps):
        micro_batches = workload.micro_batches(rank, step)
        if step_boundary is not None and step == workload.warmup_steps:
            runner.settle()  # the warmup step's in-flight bytes are not the timed steps'
        dist.barrier()
        _synchronize(device)
        if step_boundary is not None:
            step_boundary(step)
        start = time.perf_counter()
        losses += runner.backward(micro_batches)
        if step == workload.steps - 1:
            _synchronize(device)
            paused = time.perf_counter()
            after_backward = model_state_bytes(runner.model_state())
            start += time.perf_counter() - paused  # the measurement is not training time
        runner.step()
        _synchronize(device)
        if step >= workload.warmup_steps:
            times.append(time.perf_counter() - start)
        if counter is not None:
            calls = [(c.name, c.numel, str(c.dtype), c.peer) for c in counter.take() if c.name != "barrier"]
            if step >= workload.warmup_steps:
                collectives.append(calls)
    if counter is not None:
        counter.uninstall()
    if step_boundary is not None:
        settling = time.perf_counter()
        runner.settle()  # the last step's in-flight bytes are the timed steps', and so is the wait for them
        _synchronize(device)
        times[-1] += time.perf_counter() - settling
        dist.barrier()
        step_boundary(workload.steps)
    after_step = model_state_bytes(runner.model_state())
    peak = memory.peak()
    parameters = runner.full_parameters()
    if rank == 0:
        torch.save(parameters, parameters_path)
    tokens = sum(b["input_ids"].numel() for b in workload.micro_batches(rank, 0))
    return RankResult(losses, times, max(after_backward, after_step, key=lambda m: m["total"]), peak, tokens,
                      checksum(parameters), collectives)


def checksum(parameters: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(parameters):
        digest.update(name.encode())
        digest.update(parameters[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_implementation(implementation: Implementation, workload: Workload, workdir: str,
                       timeout: float = 1800.0) -> RunResult:
    """Train ``implementation`` on ``workload`` in ``workload.world_size`` new processes."""
    result = RunResult(implementation.name, implementation.stage, implementation.offload)
    result.skipped = implementation.unavailable() or implementation.unsupported(workload.settings)
    if result.skipped:
        return result
    if workload.steps <= workload.warmup_steps:
        raise ValueError(f"steps ({workload.steps}) must exceed warmup_steps ({workload.warmup_steps})")
    slug = "".join(c if c.isalnum() else "-" for c in implementation.name.lower())
    parameters_path = os.path.join(os.path.abspath(workdir), f"{slug}.parameters.pt")
    backend = "nccl" if workload.device == "cuda" else "gloo"
    try:
        result.ranks = run_distributed(workload.world_size, train_rank, implementation, workload, parameters_path,
                                       timeout=timeout, backend=backend,
                                       env=implementation.environment(workload.device))
        result.parameters_path = parameters_path
    except AssertionError as error:  # a rank raised or hung: report it, keep comparing the others
        result.failed = str(error)
    return result


def run_comparison(implementations: list[Implementation], workload: Workload, workdir: str,
                   progress: Callable[[str], None] = lambda message: None,
                   finished: Callable[[list[RunResult]], None] = lambda results: None) -> list[RunResult]:
    """Run each implementation in turn; ``progress`` gets one line as each starts and ends, ``finished`` the
    results so far as each ends."""
    os.makedirs(workdir, exist_ok=True)
    results = []
    for index, implementation in enumerate(implementations, 1):
        progress(f"[{index}/{len(implementations)}] {implementation.name} ...")
        started = time.monotonic()
        result = run_implementation(implementation, workload, workdir)
        outcome = ("skipped: " + result.skipped if result.skipped else
                   "FAILED" if result.failed else f"done in {time.monotonic() - started:.0f} s")
        progress(f"[{index}/{len(implementations)}] {implementation.name}: {outcome}")
        results.append(result)
        finished(results)
    return results
