"""The CUDA / NCCL path, on the GPUs of this machine; every test is skipped without one.

    python -m pytest tests/test_cuda.py -q          # on a GPU machine (each rank needs its own GPU)

World size: the GPUs present, at most 2. On one GPU the ranks' reduce-scatters and all-gathers are real NCCL
collectives all the same (:func:`on_gpus`, through tests/distributed.py's ``collectives_at_one_rank``: at world
size 1 they would be copies). The
reference is DDP + the same torch optimizer on the same GPUs, with deterministic kernels. Bitwise in fp32 where
the math allows (no clipping: the clipping norm is summed in another order; offload steps AdamW on the CPU,
whose kernels may round the last bit differently from DDP's CUDA foreach kernel: within 1e-6 there), as on
CPU; 16-bit runs track fp32 within the tolerances of ``tests/test_precision_mixed.py`` (losses within 5e-3,
parameters within 3e-2 relative L2).
"""

import mmap
import os
import time
import warnings

import pytest
import torch

from distributed import collectives_at_one_rank, run_distributed
from workloads import (HALF_LOSS_ATOL, HALF_PARAM_RTOL, RunConfig, batch, build_model, max_param_diff, param_groups,
                       relative_l2, train)
from zeroimpl import CPUOffload, ShardedOptimizer, estimate_memory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WORLD_SIZE = min(torch.cuda.device_count(), 2)
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS (with torch.use_deterministic_algorithms in the ranks)


def on_gpus(fn, *args, world_size: int = WORLD_SIZE, collectives: bool = True) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` GPUs over NCCL; at one GPU with real one-rank collectives
    unless ``collectives`` is False."""
    if world_size == 1 and collectives:
        fn, args = collectives_at_one_rank, (fn, *args)
    return run_distributed(world_size, fn, *args, backend="nccl", timeout=600, env=ENV)
# the host's AdamW against the CUDA kernel, fp32: last-bit differences, which Adam at lr 1e-2 can turn into
# steps of up to lr on near-zero gradients (measured on an H100, torch 2.11: 2.8e-5 against DDP, 4.2e-5 in
# the delayed-copy test, the same with no delay at all)
OFFLOAD_TOLERANCE = 1e-4

CASES = {
    "DDP": RunConfig("gpt2", None, device="cuda"),
    "stage 1": RunConfig("gpt2", 1, device="cuda"),
    "stage 2": RunConfig("gpt2", 2, device="cuda"),
    "stage 2, gathers waited in step()": RunConfig("gpt2", 2, device="cuda",
                                                   zero_kwargs={"overlap_param_gather": False}),
    "stage 2 + offload": RunConfig("gpt2", 2, device="cuda", zero_kwargs={"offload": CPUOffload(fused_step=False)}),
    "stage 2, clipping": RunConfig("gpt2", 2, device="cuda", clip=(1.0, 2.0)),
    "DDP, clipping": RunConfig("gpt2", None, device="cuda", clip=(1.0, 2.0)),
    "stage 2, bf16": RunConfig("gpt2", 2, device="cuda", dtype=torch.bfloat16),
    "stage 2, fp16 (loss scaling)": RunConfig("gpt2", 2, device="cuda", dtype=torch.float16),
    "stage 2 + offload, bf16": RunConfig("gpt2", 2, device="cuda", dtype=torch.bfloat16,
                                         zero_kwargs={"offload": CPUOffload(fused_step=False)}),
    # on one GPU the 8-bit all-gather runs under the switch (the owner decodes its own payload); the 8-bit
    # reduce-scatter, an all-to-all, only from 2 GPUs on (at one rank its own piece is exact: nothing to send)
    "stage 2, 8-bit collectives": RunConfig("gpt2", 2, device="cuda", zero_kwargs={"quantize_param_gather": True,
                                                                                  "quantize_grad_reduce": True}),
}
# tests/test_quantized_comm.py's tolerances for training with both 8-bit collectives against the same run
# unquantized, per step's loss (relative) and for the parameters (relative L2), which this case meets on CPU
QUANTIZED_LOSS_RTOL, QUANTIZED_REL_L2 = 6e-3, 0.15


def _train_all(rank, world_size):
    torch.use_deterministic_algorithms(True)
    return {name: train(config) for name, config in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return on_gpus(_train_all)


@pytest.mark.parametrize("case", ["stage 1", "stage 2", "stage 2, gathers waited in step()"])
def test_nccl_training_is_bitwise_ddp(runs, case):
    for by_name in runs:
        assert max_param_diff(by_name[case]["params"], by_name["DDP"]["params"]) == 0.0


def test_nccl_offload_tracks_ddp(runs):
    for by_name in runs:
        assert max_param_diff(by_name["stage 2 + offload"]["params"], by_name["DDP"]["params"]) <= OFFLOAD_TOLERANCE


def test_nccl_clipping_matches_ddp(runs):
    for by_name in runs:
        assert max_param_diff(by_name["stage 2, clipping"]["params"], by_name["DDP, clipping"]["params"]) < 1e-6
        for ours, theirs in zip(by_name["stage 2, clipping"]["norms"], by_name["DDP, clipping"]["norms"]):
            assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("case", ["stage 2, bf16", "stage 2, fp16 (loss scaling)", "stage 2 + offload, bf16"])
def test_16_bit_training_tracks_fp32(runs, case):
    for by_name in runs:
        run, reference = by_name[case], by_name["stage 2"]
        assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"])) <= HALF_LOSS_ATOL
        assert relative_l2(run["params"], reference["params"]) <= HALF_PARAM_RTOL
        assert run["losses"] != reference["losses"]  # it really ran in 16 bits


def test_8_bit_collectives_track_the_unquantized_run(runs):
    """The 8-bit codec's kernels on CUDA and NCCL's uint8 all-gather (and, on 2 GPUs, all-to-all), within the
    tolerances the CPU runs meet."""
    for by_name in runs:
        run, reference = by_name["stage 2, 8-bit collectives"], by_name["stage 2"]
        for a, b in zip(run["losses"], reference["losses"]):
            assert abs(a - b) <= QUANTIZED_LOSS_RTOL * abs(b), (a, b)
        assert 0 < relative_l2(run["params"], reference["params"]) <= QUANTIZED_REL_L2  # it did quantize


@pytest.mark.parametrize("signed", [False, True])
def test_the_8_bit_codec_keeps_its_bound_on_cuda(signed):
    """The codec's kernels on CUDA (the payload sliced at a rank's offset, as the all-gather writes it): every
    element within half a step of its block ((max - min) / 510, or absmax / 254 when signed), a zero block exact,
    the payload as large as on CPU."""
    from zeroimpl import quantized_comm

    torch.manual_seed(0)
    n, world = 600, 2
    codecs = [quantized_comm.ShardBlocks.of([0, 7, 300, world * n], n, world, rank, signed=signed)
              for rank in range(world)]
    shards = [(torch.randn(n) * torch.logspace(-4, 2, n)).cuda() for _ in range(world)]
    shards[1][:256] = 0.0
    size = codecs[0].payload_bytes
    gathered = torch.zeros(world * size, dtype=torch.uint8, device="cuda")
    for rank, (codec, shard) in enumerate(zip(codecs, shards)):
        codec.encode(shard, out=gathered[rank * size:(rank + 1) * size])
    assert size == codecs[0].encode(shards[0].cpu()).numel()
    out = torch.zeros(world * n, device="cuda")
    codecs[0].add_decoded(gathered, out)
    blocks = [(0, 7, 263, 300, 556, 600), (0, 256, 512, 600)]  # rank 1's shard: one parameter from its start
    for shard, values, edges in zip(shards, out.view(world, n), blocks):
        for start, end in zip(edges, edges[1:]):
            block, back = shard[start:end], values[start:end]
            half_step = block.abs().max() / 254 if signed else (block.max() - block.min()) / 510
            assert (back - block).abs().max().item() <= half_step.item() * (1 + 1e-5) + 1e-7
    assert torch.equal(out[n:n + 256], torch.zeros(256, device="cuda"))


def _batch(rank, step):
    return {k: v.cuda() for k, v in batch(rank, step, 0).items()}


def _offload_under_delayed_copies(rank, world_size, dtype):
    """Offload against no offload, with the GPU's stream held up before every backward (so that the gradient
    copies to the host queue behind it), before every step and after it, for longer on rank 1 than on rank 0
    (so that the ranks' collectives start late and out of step), with 4 reductions in flight: the copies to
    the host and back start late (bf16: through the two staging buffers, taken in turn over many buckets). A
    missing wait shows as a host step on partial gradients, a staging buffer overwritten before its copy ran,
    or a forward on stale parameters."""
    results = []
    delay = 20_000_000 * (rank + 1)  # tens of milliseconds of GPU time on the current stream, by rank
    for offload in (None, CPUOffload(fused_step=False)):
        model = build_model("gpt2", dtype).cuda()
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                     offload=offload, max_inflight_buckets=4, lr=1e-2)
        for step in range(4):
            torch.cuda._sleep(delay)
            optimizer.backward(model(**_batch(rank, step)).loss)
            torch.cuda._sleep(delay)
            optimizer.step()
            torch.cuda._sleep(delay)
            optimizer.zero_grad()
        results.append({name: p.detach().cpu() for name, p in model.named_parameters()})
    return max_param_diff(*results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_side_stream_waits_for_delayed_copies(dtype):
    """A missing wait moves parameters by about lr (1e-2); fp32 differs by the host step's last bits (bf16: 0)."""
    bound = OFFLOAD_TOLERANCE if dtype == torch.float32 else 0.0
    for difference in on_gpus(_offload_under_delayed_copies, dtype):
        assert difference <= bound, difference


def _host_syncs_per_step(rank, world_size, offload, clip):
    model = build_model("gpt2").cuda()
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload=offload, lr=1e-3)
    counts = []
    for step in range(4):
        optimizer.backward(model(**_batch(rank, step)).loss)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if clip == "torch":  # on the param.grad views: one copy of the coefficient per device
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                else:
                    optimizer.clip_grad_norm_(1.0)
                optimizer.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
        optimizer.zero_grad()
    return counts[1:]  # the first step also builds the optimizer state


@pytest.mark.parametrize("offload, clip, syncs", [(None, "optimizer", 1), (None, "torch", 1),
                                                  ("cpu", "optimizer", 2), ("cpu", "torch", 2)])
def test_host_syncs_per_step(offload, clip, syncs):
    """The step's one 5-element check all-reduce is read on the host once (clipping + step together); with
    offload the clipping coefficient is copied to the host once more (docs/design.md), also when torch's
    clip_grad_norm_ multiplies each parameter's gradient by it (a copy per parameter would block per parameter).
    The waits on events that sync-debug mode does not see are not counted here."""
    for counts in on_gpus(_host_syncs_per_step, offload, clip):
        assert counts == [syncs] * 3, counts


def _memory(rank, world_size):
    # cuBLAS's workspaces, not counted below: one per handle, and backward runs on autograd's own device thread;
    # an addmm with a bias (GPT-2's Conv1D) takes cuBLASLt's, 1 MiB (measured on an H100, torch 2.11)
    warm = torch.ones(8, 8, device="cuda", requires_grad=True)
    torch.addmm(torch.ones(8, device="cuda"), warm, warm).sum().backward()
    before = torch.cuda.memory_allocated()
    model = build_model("gpt2").cuda()
    groups = param_groups(model)
    expected = estimate_memory(groups, world_size, 2, bucket_numel=4096, rank=rank)
    others = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    others += sum(b.numel() * b.element_size() for b in model.buffers())
    optimizer = ShardedOptimizer(groups, torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-3)
    for step in range(3):  # measured after the third backward: the optimizer state and gradient shards
        if step:  # exist; the graph (activations) and the bucket buffers are freed
            optimizer.step()
        optimizer.zero_grad()
        optimizer.backward(model(**_batch(rank, step)).loss)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - others
    report = optimizer.memory_report()
    optimizer.step()
    return report, expected, held


def test_cuda_memory_is_what_estimate_memory_says():
    for report, expected, held in on_gpus(_memory):
        assert report.as_dict() == expected.as_dict()
        # the caching allocator rounds each block up to 512 bytes: allow that per tensor, nothing more
        assert expected.device.total <= held <= expected.device.total * 1.01 + 512 * 200


def _pinned(rank, world_size):
    model = build_model("gpt2", torch.bfloat16).cuda()
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu", lr=1e-3)
    optimizer.backward(model(**_batch(rank, 0)).loss)
    optimizer.step()
    report, held = optimizer.memory_report().host, optimizer.held_tensors()
    host = [s.master for s in optimizer.storages] + held["host_gradient_shard"] + held["host_staging"]
    return (all(a.registered for a in optimizer.host_arenas), all(t.is_pinned() for t in host),
            sum(a.nbytes for a in optimizer.host_arenas),
            report.master_weights + report.gradient_shard + report.bucket_buffers)


def test_offload_pins_what_the_report_counts_up_to_whole_pages():
    for arenas_registered, tensors_pinned, pinned_bytes, reported in on_gpus(_pinned):
        # each arena registers whole pages of its own (less than a page more than its slices), no fallback
        assert arenas_registered and tensors_pinned and reported <= pinned_bytes < reported + mmap.PAGESIZE


def test_arenas_side_by_side_are_each_registered_and_leave_no_cuda_error():
    """Two small arenas, made one after the other (their bytes could share a page without page alignment,
    which cudaHostRegister refuses for the second): both registered, no fallback warning, and the next kernel
    launch raises nothing left over."""
    from zeroimpl.host_memory import HostArena

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arenas = [HostArena([(5, torch.float32), (3, torch.bfloat16)], torch.device("cuda")) for _ in range(2)]
    assert all(a.registered and a.start % mmap.PAGESIZE == 0 for a in arenas)
    assert all(piece.is_pinned() for a in arenas for piece in a.slices)
    assert torch.ones(4, device="cuda").sum().item() == 4.0


def test_a_copy_into_an_arena_does_not_block_the_host():
    """A device-to-host copy into an arena's slice, queued behind a kernel of about half a second, returns with
    the stream still busy; into pageable memory (the control) the same call returns only once the copy has
    run. Catches: arena memory the driver copies as pageable (not registered, or another range registered),
    which makes offload's copies block the host. (torch's copy does not ask ``is_pinned()``: the test above
    checks what torch sees.)"""
    from zeroimpl.host_memory import HostArena

    numel = 1 << 22
    source = torch.arange(numel, device="cuda", dtype=torch.float32)

    def busy_after_the_call(target: torch.Tensor) -> bool:
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # clock cycles: about 0.5 s
        target.copy_(source, non_blocking=True)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return busy

    arena = HostArena([(numel, torch.float32)], torch.device("cuda"))
    assert busy_after_the_call(arena.slices[0]) and torch.equal(arena.slices[0], source.cpu())
    assert not busy_after_the_call(torch.empty(numel))


def _offload_around_a_fork(rank, world_size):
    """Offload training, with and without a child forked after the first step (a DataLoader worker's way)
    that lives through the next steps: the parameters after 4 steps, each way (deterministic kernels), and
    whether every arena was registered."""
    torch.use_deterministic_algorithms(True)
    results = []
    for fork in (False, True):
        model = build_model("gpt2").cuda()
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-2,
                                     offload=CPUOffload(fused_step=False))
        child, registered = None, all(a.registered for a in optimizer.host_arenas)
        for step in range(4):
            optimizer.backward(model(**_batch(rank, step)).loss)
            optimizer.step()
            optimizer.zero_grad()
            if fork and step == 0:
                child = os.fork()
                if child == 0:  # touches nothing of the parent's: as a worker that loads data
                    try:
                        time.sleep(5)
                    finally:
                        os._exit(0)
        optimizer.finish_param_gathers()
        results.append([p.detach().cpu() for p in model.parameters()])
        if child:
            os.kill(child, 9)
            os.waitpid(child, 0)
    return registered and all(map(torch.equal, *results))


def test_offload_is_unchanged_by_a_forked_child():
    """A child forked while the host arena is registered: the parent's next writes to its host masters and
    gradient shards must stay where the device's copies go (the mapping is not inherited: no copy-on-write
    moves a page away from under a copy). A regression test on kernels before 5.9 or drivers that pin without
    ``pin_user_pages``; on newer ones, where fork copies pinned pages for the child, a check that the advice
    breaks nothing."""
    assert all(on_gpus(_offload_around_a_fork))


def _checkpoint_without_set_device(rank, world_size, directory):
    """A script that moves its model with .to(f"cuda:{rank}") and never calls torch.cuda.set_device: every
    rank's current GPU is 0. The checkpoint's agreements (object all-gathers) must travel on each rank's own
    GPU, not on GPU 0 twice (NCCL: duplicate GPU, or a hang)."""
    from zeroimpl.checkpoint import save_checkpoint

    torch.cuda.set_device(0)
    model = build_model("gpt2").to(f"cuda:{rank}")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-3)
    optimizer.backward(model(**{k: v.to(f"cuda:{rank}") for k, v in batch(rank, 0, 0).items()}).loss)
    optimizer.step()
    save_checkpoint(directory, optimizer, model)
    return True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (ranks on GPU 1 and GPU 0)")
def test_checkpoint_agreements_travel_on_the_optimizers_gpu(tmp_path):
    assert run_distributed(2, _checkpoint_without_set_device, str(tmp_path / "checkpoint"), backend="nccl",
                           timeout=600) == [True, True]


def _built_before_the_move_without_set_device(rank, world_size):
    """The optimizer built on a CPU model by a script that never calls torch.cuda.set_device (every rank's current
    GPU is 0), then the model moved with .to(f"cuda:{rank}"): the construction's collectives must run on each
    rank's own GPU (torchrun's LOCAL_RANK), not on GPU 0 twice; one step."""
    torch.cuda.set_device(0)
    os.environ["LOCAL_RANK"] = str(rank)
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-3)
    model.to(f"cuda:{rank}")
    optimizer.backward(model(**{k: v.to(f"cuda:{rank}") for k, v in batch(rank, 0, 0).items()}).loss)
    optimizer.step()
    return True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (ranks on GPU 1 and GPU 0)")
def test_an_optimizer_built_before_the_move_without_set_device_communicates_on_each_ranks_gpu():
    assert run_distributed(2, _built_before_the_move_without_set_device, backend="nccl", timeout=600) == [True, True]


def _built_before_the_move(rank, world_size):
    """PyTorch's DDP tutorial under NCCL: the optimizer built while the model is on the CPU, then the model moved to
    its GPU (stage 1 also wrapped in DDP), 3 steps; against the optimizer built after the move, bitwise. Initial
    weights differ per rank: the construction's broadcast (through the GPU, the parameters still on the CPU) must
    give rank 0's. Never moved: the first backward raises on every rank, naming the move."""
    torch.use_deterministic_algorithms(True)  # (two runs compared bitwise: the embedding's backward, say)
    device = torch.device("cuda", torch.cuda.current_device())
    runs = {}
    for stage, wrap in ((1, True), (2, False)):
        params = []
        for before in (True, False):
            model = build_model("gpt2")
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(rank)
            build = lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)  # noqa: E731
            optimizer = build() if before else None
            model.to(device)
            optimizer = optimizer or build()
            forward = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device]) if wrap else model
            for step in range(3):
                optimizer.zero_grad()
                forward(**{k: v.to(device) for k, v in batch(rank, step, 0).items()}).loss.backward()
                optimizer.step()
            params.append([p.detach().clone() for p in model.parameters()])
        runs[stage] = all(torch.equal(a, b) for a, b in zip(*params))
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    try:
        model(**batch(rank, 0, 0)).loss.backward()
        runs["never moved"] = None
    except RuntimeError as error:
        runs["never moved"] = str(error)
    return runs


def test_an_optimizer_built_before_the_model_moves_to_its_gpu_trains_as_one_built_after():
    for runs in on_gpus(_built_before_the_move):
        assert runs[1] and runs[2]
        assert "backend is nccl but the parameters are on cpu" in runs["never moved"]


def test_a_host_wait_for_a_stream_is_bounded():
    """Offload's wait for its gradient copies (comm.wait_for_stream): a stream held up past the timeout raises
    CollectiveError, where stream.synchronize() would wait as long as NCCL's watchdog lets a collective hang."""
    from zeroimpl.comm import CollectiveError, wait_for_stream

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second or more of GPU time
    with pytest.raises(CollectiveError, match="did not finish within collective_timeout=0.05"):
        wait_for_stream(stream, 0.05, "test copies")
    stream.synchronize()



def _side_stream_read(rank, world_size, loop_stream: bool, quantized: bool):
    """After step(), an EMA-style read of the parameters on a side stream, then a copy of them on the loop's
    stream (the default one, or with ``loop_stream`` one of the loop's own), with rank 1's all-gathers held
    up behind a long GPU sleep: the copy must hold this step's values (the loop's stream ordered after the
    side stream's wait), as with the gathers waited for in step(). ``quantized``: 8-bit all-gathers, whose
    payload is decoded on the side stream (and must not be reused before that has run)."""
    torch.cuda.set_stream(torch.cuda.Stream() if loop_stream else torch.cuda.default_stream())
    results = []
    for overlap in (True, False):
        model = build_model("gpt2").cuda()
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-2,
                                     overlap_param_gather=overlap, quantize_param_gather=quantized)
        optimizer.backward(model(**_batch(rank, 0)).loss)
        torch.cuda._sleep(200_000_000 * rank)  # rank 1's gathers start late: rank 0's finish late
        optimizer.step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ema = [p.detach() * 0.5 for p in model.parameters()]  # the guard makes the side stream wait
        copies = [p.detach().clone() for p in model.parameters()]  # the loop's stream: no guard wait left
        torch.cuda.synchronize()
        del ema
        results.append([c.cpu() for c in copies])
    return all(map(torch.equal, *results))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a late peer)")
@pytest.mark.parametrize("loop_stream, quantized", [(False, False), (True, False), (False, True)],
                         ids=["default stream", "the loop's own stream", "8-bit all-gathers"])
def test_a_side_stream_read_leaves_the_loops_stream_ordered(loop_stream, quantized):
    assert on_gpus(_side_stream_read, loop_stream, quantized, world_size=2) == [True, True]



class _HoldUp(torch.autograd.Function):
    """The identity, whose backward first holds up the stream it runs on (its forward's) for ``cycles``."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad, None


def _branches_on_two_streams(rank, world_size, late: str, per_branch: bool):
    """Three parallel linear branches: ``first`` and ``last`` run on one stream, ``middle`` on the other and held
    up in backward (its stream sleeps before its gradients exist). ``late`` ("side" or "main") names the held-up
    stream. The engine runs the branches' backward in reverse order of their forward, so ``last``'s hooks come
    first, then ``middle``'s (their writes late, on the other stream), then ``first``'s.

    * One bucket for all six parameters (``per_branch`` False): ``last``'s hooks allocate it, ``first``'s launch
      its reduce-scatter from the first stream, which must read ``middle``'s gradients.
    * A bucket per branch, one reduction in flight, offload (``per_branch``): ``first``'s launch finishes
      ``middle``'s reduction on the first stream and copies it to the host from there; at world size 1 without a
      collective, nothing but the reducer's order puts that copy after ``middle``'s late writes.

    Every rank gets the same batch, so the averaged gradient is each rank's own; the reference is torch's AdamW on
    an unsharded copy of the model, its forward on one stream."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    names = ("first", "middle", "last")
    ours, reference = (torch.nn.ModuleDict({name: torch.nn.Linear(64, 64) for name in names}).cuda() for _ in range(2))
    reference.load_state_dict(ours.state_dict())
    options = dict(bucket_numel=64 * 65, max_inflight_buckets=1, offload=CPUOffload(fused_step=False)) \
        if per_branch else {}
    optimizer = ShardedOptimizer(ours.parameters(), torch.optim.AdamW, stage=2, lr=1e-2, **options)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert len(optimizer.layout.buckets) == (3 if per_branch else 1)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    outer, held = (side, main) if late == "main" else (main, side)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).cuda()
        optimizer.finish_param_gathers()  # the guards order only the loop's stream after the gathers, not side
        side.wait_stream(main)
        outputs = []
        for name in names:
            stream = held if name == "middle" else outer
            with torch.cuda.stream(stream):
                x.record_stream(stream)
                y = ours[name](x)
                outputs.append(_HoldUp.apply(y, 200_000_000) if name == "middle" else y)
        main.wait_stream(side)
        for y in outputs:
            y.record_stream(main)
        optimizer.backward((sum(outputs) ** 2).mean())
        optimizer.step()
        optimizer.zero_grad()
        (sum(reference[name](x) for name in names) ** 2).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    torch.cuda.synchronize()
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), reference.parameters()))


@pytest.mark.parametrize("late", ["side", "main"])
@pytest.mark.parametrize("per_branch", [False, True], ids=["one bucket, collectives", "bucket per branch, offload, "
                                                                                        "one rank, no collective"])
def test_a_gradient_written_late_on_another_stream_is_reduced_after_it(late, per_branch):
    """A missing wait reads ``middle``'s slots before they are written (NaN under deterministic algorithms, which
    fill new tensors with it; else garbage or last step's gradients): the step then fails or moves parameters by
    about lr, 1e-2. One bucket: within 1e-6, the same fp32 math summed in the same order (world size 2: each half
    of it exact). Offload: within OFFLOAD_TOLERANCE (the host's AdamW against the CUDA one)."""
    bound = OFFLOAD_TOLERANCE if per_branch else 1e-6
    for difference in on_gpus(_branches_on_two_streams, late, per_branch, world_size=1 if per_branch else WORLD_SIZE,
                              collectives=not per_branch):
        assert difference <= bound, difference
