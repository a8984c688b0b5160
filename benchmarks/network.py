"""Two nodes on one machine, joined by a link of known speed: what DDP, DeepSpeed ZeRO-2 and zeroimpl (flat,
hybrid, and each with its collectives across the link in 8 bits) cost when the link between machines is slow
(issue 29).

    python benchmarks/network.py                          # GPT-2 small and base at 1 and 10 Gbit/s (~15 min)
    python benchmarks/network.py --sizes small --rates 1gbit --only ddp zeroimpl-2   # one cell
    python benchmarks/network.py --count-collectives      # also count each rank's bytes sent to the other node
    python benchmarks/network.py --collectives 8000000    # time each collective across the link instead
    python benchmarks/network.py --sizes link --micro-batch 1 --rates 1gbit 10gbit none --report link-bound

The last is the link-bound workload (issue 47): GPT-2 with one layer, hidden 512 and a tied 65536-word
embedding (36.8M parameters, a dense embedding gradient), 1 x 16 tokens per rank, so that the bytes each step
moves are large against its compute; ``none`` is the same pair of namespaces with the veth unshaped (no tc),
which shows how far the step is from compute-bound. It writes ``link-bound.json`` and ``link-bound.md``.

The simulation (root and iproute2 needed: ``apt-get install iproute2``; it says so and exits without them)::

    namespace <prefix>n0                          namespace <prefix>n1
    node 0: torchrun agent, ranks 0 and 1         node 1: torchrun agent, ranks 2 and 3
    veth <prefix>a 10.77.0.1/24  <-- link -->  veth <prefix>b 10.77.0.2/24
    tc on each end: tbf rate R (and netem delay D, where the kernel has netem), shaping what that end sends
                  (rate ``none``: no tc at all, the veth pair as fast as the kernel copies)

Each namespace runs one ``torchrun --nnodes 2 --node_rank i`` agent (static rendezvous on node 0's address) and
its ranks bind gloo to their end of the veth pair (``GLOO_SOCKET_IFNAME``): the ranks of one node reach each
other through their namespace's loopback, so the veth counters count exactly the traffic between the nodes
(payload, TCP/IP and Ethernet headers, ACKs). Every rank reads them at its step boundaries
(:func:`zeroimpl.integrations.comparison.harness.train_rank`'s ``step_boundary``), so bytes per step are those
of the timed steps alone, without start-up or the final gather. The namespaces, and with them the veth pair,
are deleted whatever happens (an error, Ctrl-C, SIGTERM).

Per implementation it reports the median step time (every rank's timed steps), bytes across the link per step,
the loss of the last step (mean over ranks) and the model states per rank, and writes ``network.json`` and
``network.md`` to ``--out`` (default ``benchmarks/results/network``), which docs/benchmarks.md links. With
``--count-collectives`` each rank also records the bytes it sends to ranks of the other node through
``torch.distributed.isend``. zeroimpl's reduce-scatter on gloo is such a pairwise exchange, and so is its
all-gather under ``ZEROIMPL_COLLECTIVES=pairwise`` (by default an all-gather across nodes is gloo's ring, whose
bytes the counter cannot attribute to a peer): then the link must carry those bytes plus headers
(tests/test_benchmark_network.py checks this).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, RANKS_PER_NODE = 2, 2
SUBNET = "10.77.0"  # node i has address SUBNET.(i + 1)
MASTER_PORT = 29517
UNSHAPED = "none"  # a rate: the veth pair without tc
IMPLEMENTATIONS = ("ddp", "deepspeed-2", "zeroimpl-2", "zeroimpl-2-hybrid", "zeroimpl-2-int8",
                   "zeroimpl-2-hybrid-int8")


def implementation(key: str):
    """The comparison's row for ``key`` (one of IMPLEMENTATIONS); the hybrid one shards within a node and
    replicates across the NODES nodes; the int8 one is flat with ``quantize_param_gather`` and
    ``quantize_grad_reduce``; the hybrid int8 one quantizes the gradients' all-reduce across the nodes."""
    from zeroimpl.integrations.adapters import DDP, DeepSpeed, Zeroimpl

    return {"ddp": lambda: DDP(), "deepspeed-2": lambda: DeepSpeed(2), "zeroimpl-2": lambda: Zeroimpl(2),
            "zeroimpl-2-hybrid": lambda: Zeroimpl(2, replicas=NODES),
            "zeroimpl-2-int8": lambda: Zeroimpl(2, quantize=True),
            "zeroimpl-2-hybrid-int8": lambda: Zeroimpl(2, replicas=NODES, quantize="replicas")}[key]()


# -- the link ------------------------------------------------------------------------------------------------

def missing_requirements() -> str | None:
    """Why this machine cannot simulate the nodes (None when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root: run as root (or in a container with CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install iproute2"
    return None


def _run(*command: str) -> None:
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode:
        raise RuntimeError(f"`{' '.join(command)}` failed: {completed.stderr.strip()}")


@dataclass(frozen=True)
class Link:
    """Two namespaces joined by a shaped veth pair (see the module docstring); use as a context manager."""

    rate: str  # tc's spelling: "1gbit", "10gbit"; "none": unshaped
    delay_ms: float = 0.0  # one way, each direction (netem); 0: none
    prefix: str = f"zi{os.getpid() % 100000}"  # short: interface names have at most 15 characters

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def device(self, node: int) -> str:
        return f"{self.prefix}{'ab'[node]}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "Link":
        try:
            for node in range(NODES):
                _run("ip", "netns", "add", self.namespace(node))
                _run("ip", "-n", self.namespace(node), "link", "set", "lo", "up")
            _run("ip", "link", "add", self.device(0), "netns", self.namespace(0), "type", "veth", "peer", "name",
                 self.device(1), "netns", self.namespace(1))
            for node in range(NODES):
                ns, dev = self.namespace(node), self.device(node)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                tbf = ["tbf", "rate", self.rate, "burst", "512kb", "latency", "100ms"]
                if self.rate == UNSHAPED:
                    continue
                if self.delay_ms:
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                         f"{self.delay_ms}ms")
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
                else:
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for node in range(NODES):
            ns = self.namespace(node)
            # whatever still runs inside (a rank whose agent was killed) goes first
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:  # let them go before their namespace does
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                time.sleep(0.1)
            # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def bits_per_second(rate: str) -> float | None:
    """tc's rate spelling ("1gbit", "100mbit", "10gbit") in bits per second; None for ``none`` (unshaped)."""
    if rate == UNSHAPED:
        return None
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 1gbit, 100mbit, or {UNSHAPED!r}")


def link_bytes(device: str) -> int:
    """Bytes sent plus received so far by ``device``, read in the caller's own network namespace."""
    base = f"/sys/class/net/{device}/statistics"
    return sum(int(open(f"{base}/{direction}_bytes").read()) for direction in ("tx", "rx"))


@contextlib.contextmanager
def signals_raise():
    """SIGTERM (and SIGHUP) raise SystemExit while inside, so that the Link's cleanup runs as on Ctrl-C; and
    Ctrl-C (SIGINT) raises KeyboardInterrupt even where it was inherited ignored (a shell starts background
    jobs so): an interrupt always cleans up, never leaves the run going."""
    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# -- one run: two agents, one per node -----------------------------------------------------------------------

@dataclass
class Cell:
    """One implementation on one model size over one link."""

    implementation: str
    size: str
    rate: str
    delay_ms: float
    micro_batch: int  # sequences per rank and step
    median_step_seconds: float
    link_bytes_per_step: float  # both directions, timed steps only
    final_loss: float  # the last step's micro-batch losses, mean over ranks
    model_state_mib: float  # the largest rank's
    peak_rss_mib: float
    counted_cross_node_bytes_per_step: float | None = None  # isend bytes to the other node (--count-collectives)


def run_on_nodes(link: Link, script: list[str], env: dict, timeout: float = 900.0) -> list[str]:
    """Run ``python -m torch.distributed.run ... <script>`` as one agent per node of ``link`` (static rendezvous
    on node 0's address, gloo bound to each node's end of the link); return each agent's output, or raise
    with it when an agent fails (the other is stopped then) or the run outlasts ``timeout`` seconds."""
    agents, logs = [], []
    try:
        for node in range(NODES):
            node_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
                        "GLOO_SOCKET_IFNAME": link.device(node), **env}
            command = ["ip", "netns", "exec", link.namespace(node), sys.executable, "-m", "torch.distributed.run",
                       "--nnodes", str(NODES), "--nproc_per_node", str(RANKS_PER_NODE), "--node_rank", str(node),
                       "--master_addr", link.address(0), "--master_port", str(MASTER_PORT), *script]
            logs.append(tempfile.TemporaryFile("w+"))  # a file, not a pipe: no agent blocks on unread output
            agents.append(subprocess.Popen(command, env=node_env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                           text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(agent.poll() is None for agent in agents):
            if any(agent.returncode for agent in agents) or time.monotonic() > deadline:
                break  # one failed (or time is up): the finally stops the other
            time.sleep(0.2)
    finally:  # an error or an interrupt: stop the agents (which stop their ranks), then kill what is left
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if any(agent.returncode for agent in agents):
        raise RuntimeError(f"{' '.join(script)} over {link.rate} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return outputs


def run_cell(link: Link, key: str, size: str, steps: int, warmup: int, count_collectives: bool,
             workdir: str, micro_batch: int = 4) -> Cell:
    """Train ``key`` on GPT-2 ``size`` across the two nodes of ``link``, ``micro_batch`` sequences per rank."""
    out = os.path.join(workdir, f"{key}-{size}-{link.rate}.json")
    run_on_nodes(link, [os.path.abspath(__file__), "worker", key, size, str(steps), str(warmup), out,
                        str(micro_batch), *(["--count-collectives"] if count_collectives else [])],
                 implementation(key).environment("cpu"))
    ranks = json.load(open(out))
    os.remove(out)
    crossings = [r["link_bytes"][steps] - r["link_bytes"][warmup] for r in ranks]
    counted = None
    if count_collectives:
        import torch  # the dtype names the harness recorded ("torch.float32") give the element sizes

        counted = sum(numel * getattr(torch, dtype.removeprefix("torch.")).itemsize
                      for rank, r in enumerate(ranks) for calls in r["collectives"] for name, numel, dtype, peer in calls
                      if name == "isend" and peer // RANKS_PER_NODE != rank // RANKS_PER_NODE) / (steps - warmup)
    return Cell(key, size, link.rate, link.delay_ms, micro_batch,
                median_step_seconds=statistics.median(t for r in ranks for t in r["step_seconds"]),
                link_bytes_per_step=statistics.median(crossings) / (steps - warmup),
                final_loss=statistics.mean(statistics.mean(r["losses"][-(len(r["losses"]) // steps):]) for r in ranks),
                model_state_mib=max(r["model_state"]["total"] for r in ranks) / 2**20,
                peak_rss_mib=max(r["peak_bytes"] for r in ranks) / 2**20, counted_cross_node_bytes_per_step=counted)


def worker(key: str, size: str, steps: int, warmup: int, out: str, micro_batch: int, count_collectives: bool) -> None:
    """One torchrun rank: train through the comparison harness, reading the counters of its node's end of the
    link (``GLOO_SOCKET_IFNAME``) at step boundaries; rank 0 writes every rank's result to ``out``."""
    import datetime

    import torch.distributed as dist

    from zeroimpl.integrations.adapters import TrainSettings
    from zeroimpl.integrations.comparison.harness import Workload, train_rank

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    readings: list[int] = []
    device = os.environ["GLOO_SOCKET_IFNAME"]
    workload = Workload("gpt2", size, world, steps=steps, warmup_steps=warmup, count_collectives=count_collectives,
                        settings=TrainSettings(micro_batch_size=micro_batch))
    with tempfile.TemporaryDirectory() as scratch:
        result = train_rank(rank, world, implementation(key), workload, os.path.join(scratch, "parameters.pt"),
                            step_boundary=lambda step: readings.append(link_bytes(device)))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({**asdict(result), "link_bytes": readings}, gathered, dst=0)
    if rank == 0:
        with open(out + ".partial", "w") as handle:
            json.dump(gathered, handle)
        os.replace(out + ".partial", out)
    dist.destroy_process_group()


def time_collectives(rate: str, delay_ms: float, numel: int, out: str, command: str) -> None:
    """benchmarks/collectives.py across the two nodes of a link at ``rate``: ``out/collectives-<rate>.md``."""
    with Link(rate, delay_ms) as link, tempfile.TemporaryDirectory() as scratch:
        run_on_nodes(link, [os.path.join(ROOT, "benchmarks", "collectives.py"), "--numel", str(numel), "--out", scratch],
                     {})
        table = open(os.path.join(scratch, "collectives-gloo.md")).read()
    heading, rest = table.split("\n", 1)
    with open(os.path.join(out, f"collectives-{rate}.md"), "w") as handle:
        handle.write(f"{heading}, {NODES} nodes x {RANKS_PER_NODE} ranks over a {rate} link\n\nRun by `{command}` "
                     f"(benchmarks/collectives.py under one torchrun agent per simulated node).\n{rest}")
    print(f"wrote {out}/collectives-{rate}.md")


# -- the report ----------------------------------------------------------------------------------------------

def markdown(cells: list[Cell], command: str) -> str:
    """The results table, one row per (size, link, implementation): the step time (and as a ratio to DDP's), the
    bytes across the link per step and the time the link alone needs for them at its rate."""
    ddp = {(c.size, c.rate): c.median_step_seconds for c in cells if c.implementation == "ddp"}
    micro_batches = ", ".join(sorted({str(c.micro_batch) for c in cells}))
    lines = ["# Two nodes over a shaped link", "",
             f"{NODES} nodes x {RANKS_PER_NODE} ranks (network namespaces joined by a veth pair shaped with tc tbf; "
             f"link `{UNSHAPED}`: unshaped), gloo, GPT-2 of the comparison's sizes, AdamW, fp32, micro-batch "
             f"{micro_batches}, clip 1.0. Bytes across the link are both directions, per timed step, from the veth "
             "counters (headers and ACKs included); the link alone needs the larger direction's share of them at "
             "its rate (here half: the traffic is symmetric).  ",
             f"Command: `{command}`.", "",
             "| model | link | implementation | step time | vs DDP | MB across the link per step | link alone "
             "| final loss | model states per rank (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ratio = f"{c.median_step_seconds / ddp[(c.size, c.rate)]:.2f}x" if (c.size, c.rate) in ddp else "-"
        rate = bits_per_second(c.rate)
        alone = "-" if rate is None else f"{c.link_bytes_per_step / 2 * 8 / rate:.3f} s"
        lines.append(f"| gpt2 {c.size} | {c.rate} | {c.implementation} | {c.median_step_seconds:.3f} s | {ratio} "
                     f"| {c.link_bytes_per_step / 1e6:.1f} | {alone} | {c.final_loss:.4f} | {c.model_state_mib:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["tiny", "small", "base", "large",
                                                                                   "link"])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"],
                        help=f"tc rates of the link; {UNSHAPED!r}: the veth pair unshaped")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--report", default="network", help="the results' file names: <report>.json, <report>.md")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem; the kernel must have it)")
    parser.add_argument("--only", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--count-collectives", action="store_true")
    parser.add_argument("--collectives", type=int, default=None, metavar="NUMEL",
                        help="instead of training: time each collective of benchmarks/collectives.py (all-reduce, "
                             "native and pairwise reduce-scatter and all-gather) on NUMEL fp32 elements across the "
                             "nodes, per rate: collectives-<rate>.md")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "network"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "worker":
        key, size, steps, warmup, out, micro_batch = sys.argv[2:8]
        worker(key, size, int(steps), int(warmup), out, int(micro_batch), "--count-collectives" in sys.argv[8:])
        return 0
    args = parse_args(argv)
    missing = missing_requirements()
    if missing:
        print(f"benchmarks/network.py cannot simulate two nodes here: {missing}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/network.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    if args.collectives:
        with signals_raise():
            for rate in args.rates:
                time_collectives(rate, args.delay_ms, args.collectives, args.out, command)
        return 0
    cells = []
    with signals_raise(), tempfile.TemporaryDirectory() as workdir:
        for rate in args.rates:
            with Link(rate, args.delay_ms) as link:
                for size in args.sizes:
                    for key in args.only:
                        started = time.monotonic()
                        cells.append(run_cell(link, key, size, args.steps, args.warmup, args.count_collectives,
                                              workdir, args.micro_batch))
                        print(f"{key} gpt2 {size} over {rate}: {cells[-1].median_step_seconds:.3f} s/step, "
                              f"{cells[-1].link_bytes_per_step / 1e6:.1f} MB/step across the link "
                              f"({time.monotonic() - started:.0f} s)", flush=True)
    with open(os.path.join(args.out, f"{args.report}.json"), "w") as handle:
        json.dump({"command": command, "cells": [asdict(c) for c in cells]}, handle, indent=1)
    with open(os.path.join(args.out, f"{args.report}.md"), "w") as handle:
        handle.write(markdown(cells, command))
    print(f"wrote {args.out}/{args.report}.json and {args.report}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
