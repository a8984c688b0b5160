"""The 8-bit collectives (zeroimpl/quantized_comm.py), on real gloo ranks. ``quantize_param_gather=True``: the
parameter all-gather in 8 bits with an fp32 range per block of at most 256 elements, blocks starting at every
parameter.

* The codec: every element within half a quantization step of its block ((max - min) / 510), constant blocks
  exact, a partial last block, blocks that start at parameter boundaries, the payload's size.
* Training (GPT-2 tiny, AdamW, stage 2, clipped, 6 steps; 2 ranks, and 3 where shard boundaries fall
  elsewhere; a bf16 model too): every rank holds bit-identical parameters after each step
  (``verify_ranks_agree``), and each rank's shard of them is exactly the shard before the step plus the decoded
  8-bit payload of the step from it to the exact master, so the quantization error never compounds: the
  master is stepped exact, and each step sends what separates the parameters from it. Each step's loss stays
  within QUANTIZED_LOSS_RTOL of the same run unquantized (measured at most 2.0e-5 at 2 ranks, 1.5e-5 at 3); the
  parameters' relative L2 distance to that run is nonzero and within QUANTIZED_REL_L2 (measured 7.0e-4 and
  7.3e-4). Hundreds of steps: benchmarks/quantized_loss.py.
* ``quantize_grad_reduce=True``, the gradient reduce-scatter in 8 bits (symmetric blocks: zero and signs exact):
  the codec, and the collective at 2 and 3 ranks, both algorithms: bitwise this rank's own piece plus the
  decoded pieces of the others summed in fp32, within the senders' half steps of the exact sum. Training with
  it (alone, and with the quantized all-gather) stays within GRADS_LOSS_RTOL per step (measured at most 3.8e-3
  at 2 ranks, 2.3e-3 at 3) and GRADS_REL_L2 of the parameters (measured 0.097 and 0.098: at lr 1e-2 AdamW's
  first steps move each element by about lr whatever its gradient's size, so a small gradient rounded to zero
  or across it moves its element the other way); stage 1 is bitwise stage 2; the reduce-scatter moves
  (1 + 4/256) / 4 of fp32's bytes.
* The parameter all-gather moves (1 + 8/256) / 4 of fp32's bytes (the collective counter at ``isend``).
* With both, CPU offload (unfused step, as without offload) is bitwise the device run; a checkpoint saved
  at step 3 resumes bitwise to the uninterrupted run (the exact masters are saved, not the parameters);
  ``estimate_memory`` counts the fp32 master it adds for fp32 models, exactly.
* Misuse: an in-place edit between steps moves only the elements it changed into the master (a no-op clamp
  after every step leaves the masters bitwise), and one made on one rank only is overruled by the owner's values
  at the next step, so that the ranks agree again; an ``optimizer.state_dict()`` saved with the other setting,
  and ranks that differ in it, are refused on every rank; an alignment the payload cannot use, at construction.
* Schedule-free AdamW's switch to its averaged point and back publishes every bucket as a change too.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from distributed import case_results, collectives_at_one_rank, run_cases, run_distributed
from workloads import batch, build_model, param_groups, relative_l2
from zeroimpl import CPUOffload, ShardedOptimizer, estimate_memory, quantized_comm
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint
from zeroimpl.integrations.collectives import CollectiveCounter

QUANTIZED_LOSS_RTOL = 1e-4
QUANTIZED_REL_L2 = 3e-3
GRADS_LOSS_RTOL = 6e-3
GRADS_REL_L2 = 0.15
SCHEDULE_FREE_REL_L2 = 6e-3
STEPS = 6


def _codec(boundaries, shard_numel, world_size):
    return [quantized_comm.ShardBlocks.of(boundaries, shard_numel, world_size, rank) for rank in range(world_size)]


@pytest.mark.parametrize("numel", [4, 256, 264, 1000])
def test_every_element_is_within_half_a_step_of_its_block(numel):
    torch.manual_seed(numel)
    shards = [torch.randn(numel) * 10 ** rank for rank in range(3)]
    shards[1][:min(numel, 256)] = 0.0  # a block of zeros stays exactly zero
    codecs = _codec([0, 3 * numel], numel, 3)  # one parameter across the three shards
    gathered = torch.cat([codec.encode(shard) for codec, shard in zip(codecs, shards)])
    assert gathered.numel() == 3 * codecs[0].payload_bytes == 3 * (numel + 8 * -(-numel // 256))
    out = torch.zeros(3 * numel, dtype=torch.float32)
    codecs[0].add_decoded(gathered, out)
    for shard, values in zip(shards, out.view(3, numel)):
        for start in range(0, numel, 256):
            block, decoded = shard[start:start + 256], values[start:start + 256]
            assert (decoded - block).abs().max() <= (block.max() - block.min()) / 510 * (1 + 1e-5) + 1e-7
    assert torch.equal(out[numel:numel + min(numel, 256)], torch.zeros(min(numel, 256)))


def test_blocks_start_at_every_parameter():
    """A LayerNorm weight near 1 beside a bias near 1e-3 in one shard: each keeps its own scale (a shared block
    would round the whole bias to zero). Rank 1's shard has more segments, so more scales: every payload has
    room for the most."""
    weight, bias, rest = 1 + torch.randn(100) * 1e-2, torch.full((100,), 1e-3), torch.randn(312)
    codecs = _codec([0, 100, 200, 700, 1024], 512, 2)  # rank 0: weight, bias, a piece; rank 1: two pieces
    assert [len(c.segments[c.rank]) for c in codecs] == [3, 2]
    assert codecs[0].payload_bytes == codecs[1].payload_bytes == 512 + 8 * 4
    shards = [torch.cat([weight, bias, rest]), torch.randn(512)]
    out = torch.zeros(1024)
    codecs[0].add_decoded(torch.cat([c.encode(x) for c, x in zip(codecs, shards)]), out)
    assert torch.equal(out[100:200], bias)  # a constant block is exact
    assert (out[:100] - weight).abs().max() <= (weight.max() - weight.min()) / 510 * (1 + 1e-5)
    assert torch.equal(codecs[0].decoded(codecs[0].encode(shards[0])), out[:512])


def test_a_block_of_a_tiny_range_comes_back_as_its_minimum_and_an_unknown_mode_is_refused():
    (codec,) = _codec([0, 256], 256, 1)
    constant = codec.decoded(codec.encode(1 + torch.linspace(0, 1e-37, 256)))  # (1 + 1e-37 is 1 in fp32)
    assert torch.equal(constant, torch.ones(256))
    tiny = codec.decoded(codec.encode(torch.linspace(0, 1e-37, 256)))  # a range below 255 * fp32's tiny
    assert torch.equal(tiny, torch.zeros(256))
    with pytest.raises(ValueError, match="quantize_grad_reduce must be False, True or 'replicas', got 'nodes'"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(4))], torch.optim.AdamW, quantize_grad_reduce="nodes")


def _reference_payload(values: torch.Tensor, lengths, signed: bool, payload_bytes: int) -> torch.Tensor:
    """The payload as the module docstring defines it, computed block by block: each segment of ``lengths`` cut
    into blocks of 256 from its start; per block its codes, and its range (step; or minimum and step)."""
    codes, ranges, first = [], [], 0
    for length in lengths:
        for start in range(first, first + length, 256):
            block = values[start:min(start + 256, first + length)]
            if signed:
                low, step = torch.tensor(0.0), block.abs().max() / 127
                ranges.append(step.view(1))
            else:
                low, step = block.min(), (block.max() - block.min()) / 255
                ranges.append(torch.stack([low, step]))
            inverse = 1 / step if step >= torch.finfo(torch.float32).tiny else torch.tensor(0.0)
            codes.append(((block - low) * inverse).round().to(torch.int8 if signed else torch.uint8).view(torch.uint8))
        first += length
    payload = torch.zeros(payload_bytes, dtype=torch.uint8)
    range_bytes = torch.cat(ranges).view(torch.uint8)
    payload[:first], payload[first:first + range_bytes.numel()] = torch.cat(codes), range_bytes
    return payload


@pytest.mark.parametrize("signed", [False, True], ids=["affine", "symmetric"])
def test_a_shard_of_several_chunks_encodes_and_decodes_as_block_by_block(signed):
    """The codec works on stretches of whole blocks, a chunk (``quantized_comm.CHUNK`` elements) at a time, and on
    all short last blocks at once: over a shard of 2.3 chunks whose parameters' boundaries fall mid-block,
    mid-chunk and at a chunk's edge, its payload is bitwise the block-by-block definition's, and decoding gives
    each element its own block's ``low + code * step``: assigned, or added to a total (the value rounded to fp32,
    then added)."""
    chunk = quantized_comm.CHUNK
    n = 2 * chunk + 300_000
    edges = [0, 1000, 1000 + 77, chunk, chunk + 256 * 5, chunk + 256 * 5 + 3, 2 * chunk + 10, 2 * n, 3 * n]
    torch.manual_seed(1)
    blocks = quantized_comm.ShardBlocks.of(edges, n, 3, 1, signed=signed)
    values = torch.randn(n) * torch.logspace(-3, 1, n)
    published = values - torch.randn(n) * 1e-3  # the all-gather's step from these
    step = values - published
    expected = _reference_payload(step if not signed else values, blocks.segments[1], signed, blocks.payload_bytes)
    payload = blocks.encode(values, minus=None if signed else published)
    assert torch.equal(payload, expected)
    # decoding: per element low + code * step of its block (as torch.addcmul rounds it)
    low, step_size = _reference_ranges(expected, blocks.segments[1], signed, n)
    codes = expected[:n].view(torch.int8 if signed else torch.uint8).float()
    decoded = codes * step_size if signed else torch.addcmul(low, codes, step_size)
    assert torch.equal(blocks.decoded(payload), decoded)
    total = torch.randn(n)
    summed = total + decoded
    blocks.accumulate(payload, total)
    assert torch.equal(total, summed)


def test_blocks_of_zeros_come_back_positive_zeros_whatever_the_default_dtype():
    """Symmetric codes of a gradient with whole blocks of zeros (unused embedding rows): the steps and the decoded
    values are +0.0 bit for bit (a vectorised maximum of +0 and -0 may give -0), and a float64 default dtype
    changes nothing (the codec's buffers are fp32)."""
    blocks = quantized_comm.ShardBlocks.of([0, 300, 20 * 256 + 300], 20 * 256 + 300, 1, 0, signed=True)
    values = torch.zeros(blocks.shard_numel)
    values[:300] = torch.linspace(-1, 1, 300)
    expected = blocks.encode(values)
    ranges = expected[blocks.shard_numel:].view(torch.float32)
    assert not torch.signbit(ranges[2:]).any()
    decoded = blocks.decoded(expected)
    assert not torch.signbit(decoded[300:]).any()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        payload = blocks.encode(values)
        total = torch.zeros(blocks.shard_numel, dtype=torch.float32)
        blocks.accumulate(payload, total)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(payload, expected) and torch.equal(total, decoded)


def _reference_ranges(payload: torch.Tensor, lengths, signed: bool, n: int) -> tuple:
    """Per element, its block's minimum (0 for symmetric codes) and step, read from ``payload``."""
    width = 1 if signed else 2
    ranges, low, step, first, block = payload[n:].clone().view(torch.float32), torch.zeros(n), torch.zeros(n), 0, 0
    for length in lengths:
        for start in range(first, first + length, 256):
            end = min(start + 256, first + length)
            if not signed:
                low[start:end] = ranges[width * block]
            step[start:end] = ranges[width * block + width - 1]
            block += 1
        first += length
    return low, step


PARAMS, GRADS = {"quantize_param_gather": True}, {"quantize_grad_reduce": True}


def test_signed_blocks_keep_zero_and_every_sign_and_each_element_within_half_a_step():
    """The reduce-scatter's symmetric codes: a step of absmax / 127 per block, zero exact (a parameter without a
    gradient in a bucket stays exactly without one), an element off by at most half a step."""
    torch.manual_seed(0)
    (codec,) = [quantized_comm.ShardBlocks.of([0, 300, 600], 600, 1, 0, signed=True)]
    values = torch.randn(600) * torch.logspace(-6, 2, 600)
    values[100:130] = 0.0
    assert codec.payload_bytes == 600 + 4 * 4  # two parameters of two blocks each: a step per block
    decoded = codec.decoded(codec.encode(values))
    assert torch.equal(decoded[100:130], torch.zeros(30))
    for start, end in ((0, 256), (256, 300), (300, 556), (556, 600)):
        block, back = values[start:end], decoded[start:end]
        half_step = block.abs().max() / 254
        assert (back - block).abs().max() <= half_step * (1 + 1e-5)
        assert torch.all((back.sign() == block.sign()) | (block.abs() <= half_step * (1 + 1e-5)))


def _quantized_reduce_scatter(rank, world_size, algorithm):
    """Every rank's input known to every rank (seeded by rank): the output must be this rank's own piece plus
    each other rank's piece as its payload decodes, summed in fp32 in sender order, and within the sum of the
    senders' half steps of the exact sum."""
    from zeroimpl import comm

    os.environ["ZEROIMPL_COLLECTIVES"] = algorithm
    n = 300
    edges = [0, 7, 7, 500, 500, world_size * n]  # a parameter of 7 elements, one across a shard boundary
    blocks = quantized_comm.ShardBlocks.of(edges, n, world_size, rank, signed=True)
    inputs = [torch.randn(world_size * n, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    output = torch.empty(n)
    comm.reduce_scatter_quantized(output, inputs[rank], blocks, None).wait()
    mine = slice(rank * n, (rank + 1) * n)
    expected, exact, bound = inputs[rank][mine].clone(), inputs[rank][mine].clone(), torch.zeros(n)
    for sender in range(world_size):
        if sender != rank:
            piece = inputs[sender][mine]
            expected += blocks.decoded(blocks.encode(piece, rank))
            exact += piece
            bound += (blocks.decoded(blocks.encode(piece, rank)) - piece).abs()
    return torch.equal(output, expected), bool(((output - exact).abs() <= bound * (1 + 1e-5) + 1e-6).all())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["pairwise", "native"])
def test_the_quantized_reduce_scatter_sums_the_decoded_pieces_in_fp32(world_size, algorithm):
    for same, within in run_distributed(world_size, _quantized_reduce_scatter, algorithm):
        assert same and within


def _train(rank, world_size, options, stage=2, offload=False, checkpoint=None, resume=None, dtype=torch.float32):
    """GPT-2 tiny, clipped to 1.0, with the ShardedOptimizer ``options``: the losses, the final parameters,
    whether each rank's parameter shard was what the step published after every step (quantized: the shard before
    plus the decoded 8-bit step to the master; else the master), and the bytes the gradient reduce-scatters and
    the parameter all-gathers sent per step."""
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, bucket_numel=4096, lr=1e-2,
                                 verify_every=1, offload=CPUOffload(fused_step=False) if offload else None, **options)
    quantize = options.get("quantize_param_gather", False)
    first = 0
    if resume is not None:
        load_checkpoint(resume, optimizer, model)
        first = 3
    losses, exact, reduced, sent = [], True, [], []
    for step in range(first, STEPS):
        loss = model(**batch(rank, step, 0)).loss
        losses.append(loss.item())
        counter = CollectiveCounter().install()
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)  # (stage 1 reduces here)
        reduced.append(sum(c.numel * c.dtype.itemsize for c in counter.take() if c.name == "isend"))
        published = {s.bucket.index: s.published.clone() for s in optimizer.storages if s.published is not None}
        optimizer.step()
        optimizer.finish_param_gathers()
        counter.uninstall()
        sent.append(sum(c.numel * c.dtype.itemsize for c in counter.take() if c.name == "isend"))
        for storage in optimizer.storages:
            if quantize:  # the shard published before plus the decoded step to the master, every rank alike
                before = published[storage.bucket.index]
                step_to_master = storage.master - before.to(storage.master.device, storage.master.dtype)
                wide = torch.promote_types(before.dtype, torch.float32)
                expected = before.to(wide) + storage.blocks.decoded(storage.blocks.encode(step_to_master))
                exact &= torch.equal(storage.published, storage.shard)
            else:
                expected = storage.master
            exact &= torch.equal(storage.shard, expected.to(storage.shard.dtype))
        optimizer.zero_grad()
        if checkpoint is not None and step == 2:
            save_checkpoint(checkpoint, optimizer, model)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "exact": exact, "reduced": reduced, "sent": sent,
            "shard_numel": sum(bucket.shard_numel for bucket in optimizer.layout.buckets)}


def _runs(rank, world_size, directory):
    return {"plain": _train(rank, world_size, {}),
            "quantized": _train(rank, world_size, PARAMS),
            "bf16": _train(rank, world_size, PARAMS, dtype=torch.bfloat16),
            "grads": _train(rank, world_size, GRADS),
            "grads stage 1": _train(rank, world_size, GRADS, stage=1),
            "both": _train(rank, world_size, {**PARAMS, **GRADS}, checkpoint=os.path.join(directory, "step-3")),
            "offload": _train(rank, world_size, {**PARAMS, **GRADS}, offload=True),
            "resumed": _train(rank, world_size, {**PARAMS, **GRADS}, resume=os.path.join(directory, "step-3"))}


def _one_rank_runs(rank, world_size):
    return {"plain": _train(rank, world_size, {}), "quantized": _train(rank, world_size, PARAMS)}


def test_at_one_rank_the_test_switch_runs_the_8_bit_all_gather():
    """Collectives issued at one rank (the GPU kit's path on one GPU): at world size 1 the 8-bit parameter
    all-gather runs too, the owner decoding its own payload, with the invariant and the tolerances of 2 and 3
    ranks (without the switch nothing is quantized at one rank)."""
    (results,) = run_distributed(1, collectives_at_one_rank, _one_rank_runs)
    plain, quantized = results["plain"], results["quantized"]
    assert plain["exact"] and quantized["exact"]
    assert plain["losses"][0] == quantized["losses"][0]
    for a, b in zip(plain["losses"], quantized["losses"]):
        assert abs(a - b) <= QUANTIZED_LOSS_RTOL * abs(a), (a, b)
    assert 0 < relative_l2(quantized["params"], plain["params"]) <= QUANTIZED_REL_L2  # it did quantize


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, tmp_path_factory):
    return request.param, run_distributed(request.param, _runs, str(tmp_path_factory.mktemp("quantized")))


def test_ranks_agree_and_each_shard_moves_by_the_decoded_step_to_its_master(runs):
    _, by_rank = runs
    for kind in ("quantized", "bf16", "grads", "both"):
        for rank_runs in by_rank:
            assert rank_runs[kind]["exact"] and rank_runs["plain"]["exact"], kind
        first = by_rank[0][kind]["params"]
        for rank_runs in by_rank[1:]:  # (verify_every=1 also compared them after every step)
            assert all(torch.equal(first[name], value) for name, value in rank_runs[kind]["params"].items())


@pytest.mark.parametrize("kind, loss_rtol, rel_l2", [("quantized", QUANTIZED_LOSS_RTOL, QUANTIZED_REL_L2),
                                                     ("grads", GRADS_LOSS_RTOL, GRADS_REL_L2),
                                                     ("both", GRADS_LOSS_RTOL, GRADS_REL_L2)])
def test_training_tracks_the_unquantized_run(runs, kind, loss_rtol, rel_l2):
    _, by_rank = runs
    for rank_runs in by_rank:
        plain, quantized = rank_runs["plain"], rank_runs[kind]
        assert plain["losses"][0] == quantized["losses"][0]  # the same model until the first update
        for a, b in zip(plain["losses"], quantized["losses"]):
            assert abs(a - b) <= loss_rtol * abs(a), (a, b)
        distance = relative_l2(quantized["params"], plain["params"])
        assert 0 < distance <= rel_l2, distance  # it did quantize


def test_the_gradient_reduce_scatter_runs_the_same_in_stage_1_and_2(runs):
    """The same bucket buffers, so the same payloads: stage 1's one reduction per step is bitwise stage 2's."""
    _, by_rank = runs
    for rank_runs in by_rank:
        stage1, stage2 = rank_runs["grads stage 1"], rank_runs["grads"]
        assert stage1["losses"] == stage2["losses"]
        assert all(torch.equal(stage2["params"][n], v) for n, v in stage1["params"].items())


def test_each_quantized_collective_sends_about_a_quarter_of_the_bytes(runs):
    """All-gather: codes and an fp32 minimum and step per block; reduce-scatter: codes and an fp32 step."""
    _, by_rank = runs
    for rank_runs in by_rank:
        plain = rank_runs["plain"]
        gathered, reduced = (1 + 8 / 256) / 4, (1 + 4 / 256) / 4
        for kind, collective, ratio in (("quantized", "sent", gathered), ("grads", "reduced", reduced),
                                        ("both", "sent", gathered), ("both", "reduced", reduced)):
            for exact, quantized in zip(plain[collective], rank_runs[kind][collective]):
                assert quantized / exact == pytest.approx(ratio, rel=0.02), (kind, collective, exact, quantized)
        assert rank_runs["quantized"]["reduced"] == plain["reduced"] and rank_runs["grads"]["sent"] == plain["sent"]


def test_offload_and_resuming_are_bitwise(runs):
    _, by_rank = runs
    for rank_runs in by_rank:
        quantized = rank_runs["both"]
        for other in (rank_runs["offload"], rank_runs["resumed"]):
            assert quantized["losses"][-len(other["losses"]):] == other["losses"]
            assert all(torch.equal(quantized["params"][n], v) for n, v in other["params"].items())


def _hybrid(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {kind: _train(rank, world_size, {"device_mesh": mesh, **options})
            for kind, options in (("plain", {}), ("replicas", {"quantize_grad_reduce": "replicas"}),
                                  ("both", {**PARAMS, **GRADS}))}


@pytest.fixture(scope="module")
def hybrid():
    return run_distributed(4, _hybrid)


def test_on_a_mesh_the_all_reduce_across_replicas_is_quantized(hybrid):
    """A 2 x 2 mesh: ``"replicas"`` quantizes only the gradient shards' all-reduce across the replicas (a
    quantized reduce-scatter between the replicas, then an all-gather of each sum in 8 bits that every replica
    decodes alike), ``True`` the reduce-scatter in the shard group too (and ``quantize_param_gather`` the
    all-gather there). Every rank holds the same parameters (verify_every=1 on the mesh), and training tracks
    the unquantized mesh run as flat (GRADS_LOSS_RTOL, GRADS_REL_L2). Across the replicas each rank sends
    about (1 + 4/256) / 4 of the fp32 bytes that gloo's all-reduce of its shard moves between 2 replicas
    (each element once each way: 4 bytes per element)."""
    first = hybrid[0]
    for rank_runs in hybrid:
        plain = rank_runs["plain"]
        for kind in ("replicas", "both"):
            assert rank_runs[kind]["exact"] and all(torch.equal(first[kind]["params"][n], v)
                                                    for n, v in rank_runs[kind]["params"].items())
            for a, b in zip(plain["losses"], rank_runs[kind]["losses"]):
                assert abs(a - b) <= GRADS_LOSS_RTOL * abs(a), (kind, a, b)
            assert 0 < relative_l2(rank_runs[kind]["params"], plain["params"]) <= GRADS_REL_L2
        across = [q - p for q, p in zip(rank_runs["replicas"]["reduced"], plain["reduced"])]
        for sent in across:  # the shard group's reduce-scatter is the same in both: the rest crossed replicas
            assert sent / (4 * plain["shard_numel"]) == pytest.approx((1 + 4 / 256) / 4, rel=0.05), sent


def _estimated_and_measured(rank, world_size):
    model = build_model("gpt2")
    groups = param_groups(model)
    estimated = estimate_memory(groups, world_size, 2, rank=rank, bucket_numel=4096, quantize_param_gather=True)
    optimizer = ShardedOptimizer(groups, torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                 quantize_param_gather=True, quantize_grad_reduce=True)  # (no memory of its own)
    for step in range(2):
        optimizer.zero_grad()
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        measured = optimizer.memory_report()
        optimizer.step()
    return estimated.as_dict(), measured.as_dict()


def test_the_estimate_counts_the_master_it_adds():
    for estimated, measured in run_distributed(2, _estimated_and_measured):
        assert estimated == measured and measured["device"]["master_weights"] > 0


def _small(quantize, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1))
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                   **{"quantize_param_gather": quantize, **options})


def _step(model, optimizer, rank, step):
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
    optimizer.backward(model(inputs).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    optimizer.finish_param_gathers()


def _edits_keep_the_exact_master(rank):
    """In-place edits between steps: one that changes nothing (a clamp within range), and one that changes a
    single element. Only that element's master takes the edited value; every other keeps its exact master
    (comparing against the shard as the last all-gather left it, not the master)."""
    runs = {}
    for edit in ("none", "no-op clamp"):
        model, optimizer = _small(True)
        for step in range(4):
            _step(model, optimizer, rank, step)
            if edit != "none":
                with torch.no_grad():
                    for p in model.parameters():
                        p.clamp_(-1e6, 1e6)
        runs[edit] = [s.master.clone() for s in optimizer.storages]
    same = all(torch.equal(a, b) for a, b in zip(runs["none"], runs["no-op clamp"]))
    model, optimizer = _small(True)
    _step(model, optimizer, rank, 0)
    before = [s.master.clone() for s in optimizer.storages]
    with torch.no_grad():
        model[0].weight.view(-1)[rank * 256 + 3] = 0.125  # an element of this rank's shard
    optimizer.sync_masters()
    changed = torch.cat([(s.master != b).nonzero().view(-1) for s, b in zip(optimizer.storages, before)])
    new_values = torch.cat([s.master[s.master != b] for s, b in zip(optimizer.storages, before)])
    return same, changed.numel(), new_values.tolist()


def _a_state_dict_across_the_option_is_refused(rank):
    model, optimizer = _small(True)
    _step(model, optimizer, rank, 0)
    saved = optimizer.state_dict()
    other_model, other = _small(False)
    other_model.load_state_dict(model.state_dict())
    try:
        other.load_state_dict(saved)
    except ValueError as error:
        return str(error)
    return None


def _an_edit_on_one_rank_is_overruled_by_the_owner(rank):
    """Rank 1 alone overwrites the LayerNorm's weight (owned by one of the two ranks) between two steps: after
    the next step every rank holds the same parameters again, the owner's (as with an unquantized all-gather),
    where adding each step's change to every rank's own copy would carry the difference on for good."""
    from zeroimpl import DivergenceError

    model, optimizer = _small(True)
    _step(model, optimizer, rank, 0)
    if rank == 1:
        with torch.no_grad():
            model[1].weight.fill_(3.0)
    agreed = []
    for step in (1, 2):
        _step(model, optimizer, rank, step)
        try:
            optimizer.verify_ranks_agree()
            agreed.append(True)
        except DivergenceError:
            agreed.append(False)
    return agreed


def _schedule_free_modes(rank):
    """Schedule-free AdamW switches the parameters to its averaged point (``eval()``) and back (``train()``) through
    a publish of every bucket: with the 8-bit all-gather the switch is a change like a step's, sent in 8 bits.
    Returns, for the quantized and the exact run, the parameters at the evaluation point and after one more step."""
    import schedulefree

    from zeroimpl import DivergenceError

    points = {}
    for quantize in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1))
        optimizer = ShardedOptimizer(model.parameters(), schedulefree.AdamWScheduleFree, stage=2, lr=1e-2,
                                     warmup_steps=2, quantize_param_gather=quantize, quantize_grad_reduce=quantize)
        optimizer.train()
        for step in range(3):
            _step(model, optimizer, rank, step)
        optimizer.eval()
        evaluated = [p.detach().clone() for p in model.parameters()]
        optimizer.train()
        _step(model, optimizer, rank, 3)
        try:
            optimizer.verify_ranks_agree()
            agree = True
        except DivergenceError:
            agree = False
        points[quantize] = (evaluated, [p.detach().clone() for p in model.parameters()], agree)
    return points


def _state_dicts_resume_bitwise(rank):
    """``optimizer.state_dict()`` and ``model.state_dict()`` after 2 steps, loaded into a fresh pair in either
    order: 2 more steps give the uninterrupted run's parameters bitwise (the state holds the shards as
    published, from which the next step's 8-bit delta starts)."""
    model, optimizer = _small(True)
    for step in range(2):
        _step(model, optimizer, rank, step)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict()))
    for step in range(2, 4):
        _step(model, optimizer, rank, step)
    results = []
    for model_first in (True, False):
        resumed, resumed_optimizer = _small(True)
        torch.manual_seed(123)  # another initialisation: the loads must replace it
        for p in resumed.parameters():
            torch.nn.init.normal_(p)  # (an edit before any step: taken into the masters, then overwritten)
        if model_first:
            resumed.load_state_dict(saved[0])
        resumed_optimizer.load_state_dict(copy.deepcopy(saved[1]))  # (torch's loads keep the state's tensors)
        if not model_first:
            resumed.load_state_dict(saved[0])
        for step in range(2, 4):
            _step(resumed, resumed_optimizer, rank, step)
        results.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())))
    # a state without the shards as published (zeroimpl before it sent changes published the dequantized masters)
    resumed, resumed_optimizer = _small(True)
    resumed.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict({k: v for k, v in copy.deepcopy(saved[1]).items() if k != "published_shards"})
    for step in range(2, 4):
        _step(resumed, resumed_optimizer, rank, step)
    results.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), resumed.parameters())))
    return results


def _replicas_without_a_mesh(rank):
    try:
        _small(False, quantize_grad_reduce="replicas")
    except ValueError as error:
        return str(error)
    return None


def _ranks_that_differ_in_the_option(rank):
    messages = []
    for option in ("quantize_param_gather", "quantize_grad_reduce"):
        try:
            _small(False, **{option: rank == 0})
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def _misuse(rank, world_size):
    return run_cases({"edits": lambda: _edits_keep_the_exact_master(rank),
                      "state dict resume": lambda: _state_dicts_resume_bitwise(rank),
                      "one rank's edit": lambda: _an_edit_on_one_rank_is_overruled_by_the_owner(rank),
                      "replicas without a mesh": lambda: _replicas_without_a_mesh(rank),
                      "schedule-free": lambda: _schedule_free_modes(rank),
                      "state dict": lambda: _a_state_dict_across_the_option_is_refused(rank),
                      "mismatch": lambda: _ranks_that_differ_in_the_option(rank)})


@pytest.fixture(scope="module")
def misuse():
    return run_distributed(2, _misuse)


def test_an_edit_between_steps_moves_only_the_elements_it_changed(misuse):
    for same, changed, values in case_results(misuse, "edits"):
        assert same, "a no-op clamp after each step changed the masters"
        assert (changed, values) == (1, [0.125])


def test_schedule_free_switches_to_its_averaged_point_and_back(misuse):
    """With both collectives in 8 bits, the evaluation point and the next step stay within SCHEDULE_FREE_REL_L2 of the
    exact run's (measured 3.1e-3 for both), every rank alike."""
    by_rank = case_results(misuse, "schedule-free")
    for points in by_rank:
        for index in (0, 1):  # at the evaluation point, and after train() and one more step
            quantized = {str(i): p for i, p in enumerate(points[True][index])}
            exact = {str(i): p for i, p in enumerate(points[False][index])}
            assert 0 < relative_l2(quantized, exact) <= SCHEDULE_FREE_REL_L2, relative_l2(quantized, exact)
        assert points[True][2] and points[False][2]
    assert all(torch.equal(a, b) for a, b in zip(by_rank[0][True][0], by_rank[1][True][0]))  # the same point


def test_quantizing_across_replicas_without_a_mesh_is_refused(misuse):
    for message in case_results(misuse, "replicas without a mesh"):
        assert message is not None and "2-D device_mesh" in message


def test_an_edit_made_on_one_rank_only_is_overruled_by_the_owner(misuse):
    for agreed in case_results(misuse, "one rank's edit"):
        assert agreed == [True, True]


def test_optimizer_and_model_state_dicts_resume_bitwise_loaded_in_either_order(misuse):
    for model_first, optimizer_first, without_published in case_results(misuse, "state dict resume"):
        assert model_first and optimizer_first
        assert 0 < without_published < 1e-3, without_published  # starts from the dequantized masters


def test_a_state_dict_saved_with_the_other_setting_is_refused_on_every_rank(misuse):
    for message in case_results(misuse, "state dict"):
        assert message is not None and "quantize_param_gather=True" in message and "save_checkpoint" in message


def test_ranks_that_differ_in_either_option_fail_at_construction(misuse):
    for messages in case_results(misuse, "mismatch"):
        assert all(m is not None and "quantize_param_gather, quantize_grad_reduce" in m for m in messages), messages
