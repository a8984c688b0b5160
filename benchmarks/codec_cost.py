"""What the 8-bit collectives' own arithmetic costs per element, held against one pass over memory (issue 47).

    python benchmarks/codec_cost.py [--numel 9200000] [--repeats 7]

One shard of ``--numel`` elements, the last of 4 ranks' shards of a bucket cut where GPT-2's parameters start
and end (hidden 512: a 65536 x 512 embedding, then matrices, biases, LayerNorms; so the shard has whole-block
stretches and short last blocks), on one CPU
thread. Per operation of :class:`zeroimpl.quantized_comm.ShardBlocks` as the collectives use it -- the
gradients' reduce-scatter encodes each piece it sends (symmetric codes) and its owner decodes and adds each
piece it receives; the parameters' all-gather encodes the step from the published parameters to the master
(affine codes) and every rank decodes and adds each rank's step to its parameters -- the
fastest of ``--repeats`` runs, in nanoseconds per element and in passes of memory: one pass is an fp32 copy of
the shard (``out.copy_(values)``: 4 bytes read and 4 written per element), timed the same way, and once more
into freshly allocated memory (what a shard-sized temporary costs on top of its pass). Writes
benchmarks/results/codec_cost.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from zeroimpl.quantized_comm import ShardBlocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_boundaries(numel: int, hidden: int = 512) -> list[int]:
    """Parameter boundaries of GPT-2 layers (hidden ``hidden``) repeated to cover ``numel`` elements."""
    sizes = [65536 * hidden, 16 * hidden]  # the (tied) embedding and the positions
    layer = [hidden, hidden, hidden * 3 * hidden, 3 * hidden, hidden * hidden, hidden, hidden, hidden,
             hidden * 4 * hidden, 4 * hidden, 4 * hidden * hidden, hidden]
    edges, end = [0], 0
    while end < numel:
        for size in sizes + layer * 4:
            end += size
            edges.append(end)
    return edges


def fastest(function, repeats: int) -> float:
    function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=9_200_000, help="shard elements (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "codec_cost.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, world = args.numel, 4
    edges = [e for e in gpt2_boundaries(world * n) if e < world * n] + [world * n]
    values, copy = torch.randn(n), torch.empty(n)
    one_pass = fastest(lambda: copy.copy_(values), args.repeats)
    into_fresh = fastest(lambda: torch.empty(n).copy_(values), args.repeats)  # every page faulted in anew
    rows = []
    for signed, use in ((True, "gradients' reduce-scatter"), (False, "parameters' all-gather")):
        blocks = ShardBlocks.of(edges, n, world, world - 1, signed=signed)
        published = values - torch.rand(n) * 1e-3  # the all-gather sends the step from these to the master
        payload = blocks.encode(values, minus=None if signed else published)
        total = torch.zeros(n)
        if signed:
            timed = [("encode", lambda: blocks.encode(values, out=payload)),
                     ("decode and add (the owner's sum)", lambda: blocks.accumulate(payload, total))]
        else:
            gathered, parameters = payload.repeat(world), torch.zeros(world * n)
            timed = [("encode the step from the published parameters",
                      lambda: blocks.encode(values, out=payload, minus=published)),
                     ("decode and add (to the parameters)",
                      lambda: blocks.add_decoded(gathered, parameters, [world - 1]))]
        for name, function in timed:
            seconds = fastest(function, args.repeats)
            rows.append((f"{'symmetric' if signed else 'affine'} ({use})", name, seconds))
    segments = ShardBlocks.of(edges, n, world, world - 1).segments[world - 1]
    short = sum(1 for length in segments if length % 256)
    lines = ["# 8-bit collectives: encode and decode per element", "",
             f"Command: `python benchmarks/codec_cost.py{''.join(' ' + a for a in (argv or sys.argv[1:]))}`; one shard "
             f"of {n:,} elements cut at GPT-2 (hidden 512) parameter boundaries (the last of 4 ranks' shards: the end of "
             f"the embedding, then layers; {len(segments)} segments, {short} with a short last block), "
             f"blocks of 256, torch {torch.__version__}, 1 CPU thread. Fastest of {args.repeats} runs. One pass of "
             f"memory (an fp32 copy of the shard, 8 bytes per element moved): {one_pass / n * 1e9:.2f} ns per "
             f"element; the same copy into freshly allocated memory, whose pages fault in as they are first written: "
             f"{into_fresh / n * 1e9:.2f} ns per element.", "",
             "| codes | operation | ns per element | passes of memory |", "|---|---|---|---|"]
    for codes, name, seconds in rows:
        lines.append(f"| {codes} | {name} | {seconds / n * 1e9:.2f} | {seconds / one_pass:.1f} |")
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
