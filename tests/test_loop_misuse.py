"""What zeroimpl cannot do as torch does raises a clear error on every rank before any wrong update; what
it can, it does (reentrant checkpointing, a retried backward, buffers, 16-bit gradients at odd world
sizes); and ``verify_every`` catches ranks that diverge.

Each case builds its own model and optimizer; the 2-rank cases run in one launch.
"""

import contextlib
import os
import resource

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distributed import case_result, run_cases, run_distributed
from workloads import SmallNet, small_batch
from zeroimpl.integrations.collectives import CollectiveCounter, summarize
from zeroimpl import ShardedOptimizer, broadcast_buffers, comm


def _optimizer(model, stage, **kwargs):
    return ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_numel=200, lr=1e-3, **kwargs)


def _error_of(action) -> str:
    try:
        action()
    except Exception as error:  # the test asserts the type and the message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _changed_model(stage, change, when="after a step"):
    """Train one step, change the model as the user would, train on: the error, and whether the parameters
    moved before it was raised."""
    model = SmallNet()
    optimizer = _optimizer(model, stage)
    model(small_batch(0, 0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    change(model)
    before = [p.detach().clone() for p in model.parameters()]

    def train_on():
        model(small_batch(0, 1).to(model.head.weight.dtype)).backward()
        optimizer.step()

    message = _error_of(train_on)
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return message, unchanged


def _unfreeze_later(stage):
    model = SmallNet()
    model.aux_head.requires_grad_(False)
    optimizer = _optimizer(model, stage)
    model(small_batch(0, 0), use_aux=True).backward()
    optimizer.step()
    model.aux_head.requires_grad_(True)
    model(small_batch(0, 1), use_aux=True).backward()
    return _error_of(optimizer.step)


def _resize_embeddings(stage):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = _optimizer(model, stage)
    model.resize_token_embeddings(80)
    ids = torch.randint(0, 80, (2, 8), generator=torch.Generator().manual_seed(0))
    return _error_of(lambda: (model(input_ids=ids, labels=ids).loss.backward(), optimizer.step()))


def _compiled_autograd(stage):
    """Backward under compiled autograd (as torch.compile with torch._dynamo.config.compiled_autograd=True
    runs it; entered here the way torch's own tests do)."""
    from torch._dynamo import compiled_autograd

    model = SmallNet()
    optimizer = _optimizer(model, stage)
    try:
        with compiled_autograd._enable(torch.compile(backend="eager")):
            return _error_of(lambda: (model(small_batch(0, 0)).backward(), optimizer.step()))
    finally:
        torch._dynamo.reset()


class _FailOnce(torch.autograd.Function):
    """Identity whose first backward raises, as an out-of-memory error part-way through backward would."""

    failures_left = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.failures_left:
            _FailOnce.failures_left -= 1
            raise RuntimeError("simulated failure part-way through backward")
        return grad


class _FailingNet(SmallNet):
    def forward(self, x, **kwargs):
        h = _FailOnce.apply(torch.tanh(self.embed(x)))  # backward fails after the body and head hooks ran
        for layer in self.body:
            h = torch.tanh(layer(h))
        return (self.head(h) - 0.5).square().mean()


def _retried_backward(rank, world_size, stage):
    """A backward that fails part-way, retried without zero_grad(): torch keeps the gradients the failed
    backward had accumulated and adds the second backward's. Returns (zeroimpl's, torch's) parameters after one SGD
    step; torch's is one process per rank with the gradients averaged by hand."""
    results = []
    for implementation in ("zeroimpl", "torch"):
        model = _FailingNet()
        if implementation == "zeroimpl":
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, bucket_numel=200, lr=0.1)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _FailOnce.failures_left = 1
        try:
            model(small_batch(rank, 0)).backward()
        except RuntimeError as error:
            assert "simulated failure" in str(error)
        model(small_batch(rank, 0)).backward()
        if implementation == "torch":
            for p in (p for p in model.parameters() if p.grad is not None):  # aux_head: unused
                dist.all_reduce(p.grad)
                p.grad /= world_size
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def _reduce_scatters_per_backward(stage, checkpointing):
    os.environ["ZEROIMPL_COLLECTIVES"] = "native"
    counter = CollectiveCounter().install()
    try:
        model = SmallNet()
        optimizer = _optimizer(model, stage)
        counter.take()
        model(small_batch(0, 0), checkpointing=checkpointing).backward()
        calls = summarize(counter.take()).get("reduce_scatter_single", (0, 0, set()))[0]
        optimizer.step()
        return calls, len(optimizer.layout.buckets)
    finally:
        counter.uninstall()
        del os.environ["ZEROIMPL_COLLECTIVES"]


class _NormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.linear(x)).square().mean()


def _buffers(rank, mode):
    """Running statistics and parameters after 3 steps: DDP, zeroimpl with broadcast_buffers, ZeroTrainer's
    model wrapper, and zeroimpl without either."""
    from zeroimpl.integrations.trainer import ShardedModule

    model = _NormNet()
    if mode == "ddp":
        forward, optimizer = DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        forward, optimizer = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        if mode == "broadcast":
            broadcast_buffers(model)
        elif mode == "trainer":
            forward = ShardedModule(model)
    for step in range(3):
        forward(small_batch(rank, step) * (1 + rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _verify(rank, stage):
    """verify_every=2: a rank-dependent edit of a frozen parameter after step 1 is caught at step 2; an edit
    of a trainable parameter is caught by an explicit verify_ranks_agree(). Normal training never trips. Frozen
    members of 1-byte dtypes (a QLoRA model's uint8 codes, a bool mask) are checked too."""
    model = SmallNet()
    model.aux_head.requires_grad_(False)
    model.register_parameter("codes", torch.nn.Parameter(torch.arange(8, dtype=torch.uint8), requires_grad=False))
    model.register_parameter("mask", torch.nn.Parameter(torch.ones(3, dtype=torch.bool), requires_grad=False))
    optimizer = ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, stage=stage, bucket_numel=200,
                                 lr=1e-3, verify_every=2)
    for step in range(4):
        model(small_batch(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    clean = "no error"
    model(small_batch(rank, 4)).backward()
    optimizer.step()  # step 5: not checked
    with torch.no_grad():
        if rank == 1:
            model.aux_head.bias[0] += 1e-3
    model(small_batch(rank, 5)).backward()
    frozen_edit = _error_of(optimizer.step)  # step 6: checked
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # the failed check left a finished step: no gradient is left to apply again
    consumed = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():
        model.aux_head.bias.copy_(SmallNet().aux_head.bias)
        kept = model.body[2].weight[3, 3].clone()
        if rank == 1:
            model.body[2].weight[3, 3] += 1e-3
    trainable_edit = _error_of(optimizer.verify_ranks_agree)
    with torch.no_grad():
        model.body[2].weight[3, 3] = kept
        if rank == 1:
            model.codes[5] += 1
    codes_edit = _error_of(optimizer.verify_ranks_agree)
    with torch.no_grad():
        model.codes[5] = 5
        if rank == 1:
            model.mask[1] = False
    mask_edit = _error_of(optimizer.verify_ranks_agree)
    return clean, frozen_edit, trainable_edit, consumed, codes_edit, mask_edit


def _local_gradient_edited_in_stage1():
    """A local gradient kept from a hook of the user's and scaled after backward: stage 1 averages at the step,
    so the edit would act on this rank's gradient alone (``.grad`` itself is the averaged view after backward)."""
    model = SmallNet()
    optimizer = _optimizer(model, 1)
    kept = []
    model.body[0].weight.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    model(small_batch(0, 0)).backward()
    kept[0].mul_(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    message = _error_of(optimizer.step)
    return message, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _rebuild_after_delete():
    """The recovery the unfreezing error names: delete the optimizer, build another; and a second optimizer
    over the same parameters is refused without breaking the first."""
    model = SmallNet()
    optimizer = _optimizer(model, 2)
    refused = _error_of(lambda: _optimizer(model, 2))
    model(small_batch(0, 0)).backward()
    optimizer.step()  # the first optimizer still trains the model
    first_still_trains = not torch.equal(model.body[0].weight, SmallNet().body[0].weight)
    del optimizer
    rebuilt = _error_of(lambda: _optimizer(model, 2))
    return refused, first_still_trains, rebuilt


def _old_state_dict():
    model = SmallNet()
    optimizer = _optimizer(model, 2)
    state = optimizer.state_dict()
    state["format"] = "zeroimpl.sharded_optimizer/1"
    return _error_of(lambda: optimizer.load_state_dict(state))


def _scalar_parameter_from_torch(tmp):
    """A 0-dim parameter (a learnable temperature): Adam's `step` and `exp_avg` have its shape."""
    from zeroimpl.checkpoint import load_torch_optimizer_state, save_checkpoint

    model = SmallNet()
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (model(small_batch(0, 0)) * model.temperature).backward()
    plain.step()
    optimizer = _optimizer(model, 2)
    load_torch_optimizer_state(optimizer, plain.state_dict())
    return _error_of(lambda: save_checkpoint(tmp, optimizer, model))


def _two_ranks(rank, world_size, shared_directory):
    cases = {}
    for stage in (1, 2):
        cases[("double", stage)] = lambda stage=stage: _changed_model(stage, lambda m: m.double())
        cases[("half", stage)] = lambda stage=stage: _changed_model(stage, lambda m: m.half())
        cases[("cpu:0", stage)] = lambda stage=stage: _changed_model(stage, lambda m: m.to(torch.device("cpu", 0)))
        cases[("param.data", stage)] = lambda stage=stage: _changed_model(
            stage, lambda m: setattr(m.head.weight, "data", torch.zeros_like(m.head.weight)))
        cases[("assign", stage)] = lambda stage=stage: _changed_model(
            stage, lambda m: m.load_state_dict(SmallNet().state_dict(), assign=True))
        cases[("unfreeze", stage)] = lambda stage=stage: _unfreeze_later(stage)
        cases[("resize", stage)] = lambda stage=stage: _resize_embeddings(stage)
        cases[("compiled", stage)] = lambda stage=stage: _compiled_autograd(stage)
        cases[("retried", stage)] = lambda stage=stage: _retried_backward(rank, world_size, stage)
        cases[("verify", stage)] = lambda stage=stage: _verify(rank, stage)
        for checkpointing in (None, "reentrant", "non-reentrant"):
            cases[("reduce-scatters", stage, checkpointing)] = (
                lambda stage=stage, checkpointing=checkpointing: _reduce_scatters_per_backward(stage, checkpointing))
    cases[("local edit", 1)] = _local_gradient_edited_in_stage1
    for stage, then in ((2, "backward"), (2, "step under Join"), (2, "skip"), (1, "step again")):
        cases[("out of memory", stage, then)] = lambda stage=stage, then=then: _out_of_memory(rank, stage, then)
    for where in ("8-bit sum", "8-bit gather", "8-bit gather in the step"):
        cases[("out of memory", where)] = lambda where=where: _out_of_memory_landing(rank, where)
    cases["rebuild"] = _rebuild_after_delete
    cases["old state dict"] = _old_state_dict
    cases["scalar parameter"] = lambda: _scalar_parameter_from_torch(os.path.join(shared_directory, "scalar"))
    for mode in ("ddp", "broadcast", "trainer", "none"):
        cases[("buffers", mode)] = lambda mode=mode: _buffers(rank, mode)
    return run_cases(cases)  # one case failing unexpectedly must not hide the others


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(2, _two_ranks, str(tmp_path_factory.mktemp("checkpoints")))


STAGES = (1, 2)


CAUSES = {  # what the error tells of each change
    "double": "converted from torch.float32 to torch.float64",
    "half": "converted from torch.float32 to torch.float16",
    "param.data": "copied onto the device it was already on",
    # a framework's device placement on CPU (accelerate's prepare, Trainer): .to() copies onto cpu:0
    "cpu:0": "copied onto the device it was already on, which is what a framework's device placement does",
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("change", sorted(CAUSES))
def test_converting_the_model_after_building_raises_before_any_update(two_ranks, change, stage):
    for results in two_ranks:
        message, unchanged = case_result(results, (change, stage))
        assert message.startswith("RuntimeError") and "no longer live in the optimizer's flat buffers" in message
        assert CAUSES[change] in message and "build the optimizer" in message and unchanged
        for route in ("strategy=\"zero2\"", "zeroimpl.integrations.accelerate.prepare", "ZeroTrainer"):
            assert route in message


@pytest.mark.parametrize("stage", STAGES)
def test_replacing_parameters_raises(two_ranks, stage):
    for results in two_ranks:
        message, unchanged = case_result(results, ("assign", stage))
        assert message.startswith("RuntimeError") and "replaced parameters" in message and "assign=True" in message
        assert unchanged


@pytest.mark.parametrize("stage", STAGES)
def test_resizing_token_embeddings_raises(two_ranks, stage):
    for results in two_ranks:
        assert "no longer live in the optimizer's flat buffers" in case_result(results, ("resize", stage))


class _WithUnusedMatrix(SmallNet):
    """SmallNet and a 32M-element parameter no forward uses: its bucket (128 MB) is launched, as zeros, only when
    the round closes at the end of backward."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(UNUSED_NUMEL))


# 128 MB in fp32, out of reach under the cap below (half of it): a request glibc cannot serve from memory the
# process already maps, so it needs a new mapping, which the cap counts. Every large buffer of these cases (the
# bucket, its 64 MB shard) is over glibc's largest mmap threshold (32 MB): mapped and unmapped, never left in the
# heap. A bucket of 32 MB came from heap memory that earlier cases freed, and then did not fail (2 of 4 in CI)
UNUSED_NUMEL = 32 * 2**20


@contextlib.contextmanager
def _address_space_capped(headroom: int):
    """Let this process map at most ``headroom`` more bytes (RLIMIT_AS): a larger allocation fails for real,
    as on a full GPU."""
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)


def _out_of_memory(rank, stage, then):
    """Rank 0 runs out of memory allocating the unused parameter's bucket: at the end of a backward (stage 2: the
    round's close) or in the step (stage 1: the reduction), and goes on as ``then`` says:

    * ``backward``: a second backward, then the step, without zero_grad() (torch keeps the gradients);
    * ``step under Join``: the step at once, inside ``with Join([optimizer])``;
    * ``skip``: zero_grad() at once; the ranks agree that one failed (an all-reduce) and skip the batch: zero_grad()
      on every rank, a second backward and the step;
    * ``step again``: the step called again.

    Returns the error, and the parameters, then the same where nothing failed (``skip``: the batch skipped too)."""
    from torch.distributed.algorithms.join import Join
    runs = {}
    for out_of_memory in (True, False):
        model = _WithUnusedMatrix()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, bucket_numel=200, lr=0.1)
        capped = _address_space_capped(UNUSED_NUMEL * 2) if out_of_memory and rank == 0 else contextlib.nullcontext()
        with Join([optimizer]) if then == "step under Join" else contextlib.nullcontext():
            if then == "step again":
                model(small_batch(rank, 0)).backward()
                with capped:  # 128 MB is out of reach, the rest of the step is not
                    error = _error_of(optimizer.step)
                if error != "no error":
                    optimizer.step()
            else:
                with capped:
                    error = _error_of(lambda: model(small_batch(rank, 0)).backward())
                if then == "skip":
                    if error != "no error":
                        optimizer.zero_grad()
                    dist.all_reduce(torch.tensor([float(error != "no error")]))  # (every rank skips it)
                    optimizer.zero_grad()
                if then in ("backward", "skip"):
                    model(small_batch(rank, 1)).backward()
                optimizer.step()
        runs[out_of_memory] = error, [p.detach().clone() for p in model.parameters() if p is not model.unused]
        del model, optimizer
    return runs[True][0], runs[True][1], runs[False][1]


class _LayerAndLargeMatrix(torch.nn.Module):
    """A linear layer and a 32M-element parameter (128 MB) whose gradient is the batch's mean everywhere: the same
    value in every 8-bit block, so that its 8-bit reduce-scatter and step gather are exact. Every parameter gets a
    gradient in every backward (no bucket waits for the end of backward to launch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 4)
        self.large = torch.nn.Parameter(torch.zeros(LARGE_NUMEL))

    def forward(self, x):
        return self.layer(x).square().mean() + self.large.sum() * x.mean()


# a shard of 64 MB in fp32 at world size 2: over glibc's largest mmap threshold (32 MB), so a new mapping
LARGE_NUMEL = UNUSED_NUMEL


def _out_of_memory_landing(rank, where):
    """Rank 0 runs out of memory after a collective has arrived, in the work that lands it: the sum of the 8-bit
    pieces of the large parameter's reduce-scatter (64 MB in fp32, at the end of backward) or the addition of the
    decoded 8-bit step of its all-gather (in finish_param_gathers(); with ``overlap_param_gather=False``, in the
    step). Then the step, or the wait again (in the step: nothing, the next forward reads the parameters), and a
    second backward and step. Returns the error, the parameters, and the parameters where nothing failed."""
    runs = {}
    for out_of_memory in (True, False):
        model = _LayerAndLargeMatrix()
        quantized = "quantize_grad_reduce" if where == "8-bit sum" else "quantize_param_gather"
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, bucket_numel=200, lr=0.1,
                                     max_inflight_buckets=100, overlap_param_gather=where != "8-bit gather in the step",
                                     **{quantized: True})  # (all reductions waited in the step)
        # 16 MB more: the 64 MB the landing allocates first is out of reach, even with the 33 MB of 8-bit payloads
        # let go between the cap and the sum
        capped = _address_space_capped(2**24) if out_of_memory and rank == 0 else contextlib.nullcontext()
        if where == "8-bit sum":
            # capped once the last parameter's gradient has arrived, after the optimizer's hook for it issued the
            # last reduce-scatter: the end of backward waits for them and sums their pieces
            arrived, stack = [], contextlib.ExitStack()

            def cap_after_the_last(param):
                arrived.append(param)
                if len(arrived) == len(list(model.parameters())):
                    stack.enter_context(capped)
            handles = [p.register_post_accumulate_grad_hook(cap_after_the_last) for p in model.parameters()]
            with stack:
                error = _error_of(lambda: model(small_batch(rank, 0)).backward())
            for handle in handles:
                handle.remove()
        elif where == "8-bit gather in the step":
            # capped once the large bucket's all-gather is issued: the end of the step lands it
            model(small_batch(rank, 0)).backward()
            issue, stack = comm.all_gather, contextlib.ExitStack()

            def cap_once_issued(output, *args, **kwargs):
                pending = issue(output, *args, **kwargs)
                if output.numel() > LARGE_NUMEL // 2:
                    stack.enter_context(capped)
                return pending
            comm.all_gather = cap_once_issued
            with stack:
                error = _error_of(optimizer.step)
            comm.all_gather = issue
        else:
            model(small_batch(rank, 0)).backward()
            optimizer.step()
            with capped:
                error = _error_of(optimizer.finish_param_gathers)
        if where == "8-bit sum":
            optimizer.step()
        elif where == "8-bit gather":
            optimizer.finish_param_gathers()
        model(small_batch(rank, 1)).backward()
        optimizer.step()
        optimizer.finish_param_gathers()
        runs[out_of_memory] = error, [p.detach().clone() for p in model.parameters()]
        del model, optimizer
    return runs[True][0], runs[True][1], runs[False][1]


@pytest.mark.parametrize("stage", STAGES)
def test_unfreezing_a_parameter_frozen_at_construction_raises(two_ranks, stage):
    for results in two_ranks:
        message = case_result(results, ("unfreeze", stage))
        assert message.startswith("RuntimeError") and "frozen (requires_grad=False) when the" in message


@pytest.mark.parametrize("stage", STAGES)
def test_compiled_autograd_is_refused_clearly(two_ranks, stage):
    for results in two_ranks:
        message = case_result(results, ("compiled", stage))
        assert "does not support compiled autograd" in message, message


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_backward_retried_without_zero_grad_trains_as_torch(two_ranks, stage):
    """SGD, one step: the same sums in another order, so 1e-6 (the defect: a misleading error)."""
    for results in two_ranks:
        ours, reference = case_result(results, ("retried", stage))
        assert max((a - b).abs().max().item() for a, b in zip(ours, reference)) < 1e-6


@pytest.mark.parametrize("stage, then", [(2, "backward"), (2, "step under Join"), (2, "skip"), (1, "step again")])
def test_a_reduction_that_ran_out_of_memory_is_finished_by_what_comes_next(two_ranks, stage, then):
    """The failed launch issued no collective for the bucket whose buffer it could not allocate; whatever the loop
    does next (another backward, the step, zero_grad()) launches it and every bucket after it before any other
    collective, as rank 1 did: the ranks stay in step, and training goes on bitwise as if nothing had failed.
    Before: TypeError at the next backward (the round's callback gone); under Join the check-in, and after
    zero_grad() the next round, met rank 1's last reduce-scatters (a hang); the step tried again launched nothing."""
    for rank, results in enumerate(two_ranks):
        error, recovered, uninterrupted = case_result(results, ("out of memory", stage, then))
        if rank == 0:
            assert error.startswith("RuntimeError") and "can't allocate memory" in error, error
        else:
            assert error == "no error"
        assert all(map(torch.equal, recovered, uninterrupted))


@pytest.mark.parametrize("where", ["8-bit sum", "8-bit gather", "8-bit gather in the step"])
def test_a_collective_whose_landing_ran_out_of_memory_lands_at_the_next_wait(two_ranks, where):
    """The collective arrived; the work after it (the sum of the 8-bit pieces, the addition of the decoded step)
    raised on rank 0 and runs again at the next wait: training goes on bitwise as if nothing had failed. Before:
    the wait was dropped with its work, so rank 0 lost that bucket's gradient shard (or, gathering, the step of
    its parameters) without a word; and a step that waits for its gathers (overlap_param_gather=False) raised
    before its bookkeeping, with no guard left on the half-landed parameters for the next forward."""
    for rank, results in enumerate(two_ranks):
        error, recovered, uninterrupted = case_result(results, ("out of memory", where))
        if rank == 0:
            assert error.startswith("RuntimeError") and "can't allocate memory" in error, error
        else:
            assert error == "no error"
        assert all(map(torch.equal, recovered, uninterrupted))


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpointing_reduces_each_bucket_once_per_backward(two_ranks, stage, checkpointing):
    for results in two_ranks:
        calls, buckets = case_result(results, ("reduce-scatters", stage, checkpointing))
        plain, _ = case_result(results, ("reduce-scatters", stage, None))
        assert calls == plain == (buckets if stage == 2 else 0)


@pytest.mark.parametrize("mode", ["broadcast", "trainer"])
def test_broadcast_buffers_keeps_ranks_identical_as_ddp_does(two_ranks, mode):
    for results in two_ranks:
        ddp, ours = case_result(results, ("buffers", "ddp")), case_result(results, ("buffers", mode))
        assert all(torch.equal(ddp[name], ours[name]) for name in ddp)
    without = [case_result(results, ("buffers", "none"))["norm.running_mean"] for results in two_ranks]
    assert not torch.equal(*without)  # without it, each rank keeps its own statistics


@pytest.mark.parametrize("stage", STAGES)
def test_verify_every_catches_ranks_that_diverge(two_ranks, stage):
    for results in two_ranks:
        clean, frozen_edit, trainable_edit, consumed, codes_edit, mask_edit = case_result(results, ("verify", stage))
        assert clean == "no error" and consumed
        assert frozen_edit.startswith("DivergenceError") and "after step 6" in frozen_edit
        assert "'aux_head.bias' (shape (4,))" in frozen_edit
        assert trainable_edit.startswith("DivergenceError") and "'body.2.weight' (shape (16, 16))" in trainable_edit
        assert codes_edit.startswith("DivergenceError") and "'codes' (shape (8,))" in codes_edit
        assert mask_edit.startswith("DivergenceError") and "'mask' (shape (3,))" in mask_edit


def _bf16_gradient_at_three_ranks(rank, world_size):
    """One SGD(lr=1) step on a bf16 model: the fp32 master moves by exactly the averaged gradient's rounding
    of the exact fp32 mean of the ranks' bf16 gradients."""
    model = SmallNet().to(torch.bfloat16)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, bucket_numel=200, lr=1.0)
    before = [m.clone() for m in optimizer.state_dict()["master_weights"]]
    reference = SmallNet().to(torch.bfloat16)
    reference(small_batch(rank, 0).bfloat16(), use_aux=True).float().backward()
    grads = [p.grad.double() for p in reference.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    model(small_batch(rank, 0).bfloat16(), use_aux=True).float().backward()
    optimizer.step()
    after = optimizer.state_dict()["master_weights"]
    mean = {i: (g / world_size).float().reshape(-1) for i, g in enumerate(grads)}
    worst = 0.0
    for storage, b, a in zip(optimizer.storages, before, after):
        for piece in optimizer.layout.pieces(rank):
            if piece.bucket_index == storage.bucket.index:
                window = slice(piece.shard_offset, piece.shard_offset + piece.length)
                expected = mean[piece.param_index][piece.param_start:piece.param_end]
                moved = (b[window] - a[window]).double()
                scale = expected.abs().max().item() or 1.0
                worst = max(worst, ((moved - expected.double()).abs().max().item()) / scale)
    return worst


def test_16bit_gradients_average_in_fp32_at_a_world_size_that_is_not_a_power_of_two():
    """Measured: 3e-7 of each parameter's largest gradient (fp32 rounding of the master update); dividing
    in bf16 before widening was 4e-3 off."""
    for worst in run_distributed(3, _bf16_gradient_at_three_ranks):
        assert worst < 1e-5


def test_a_local_gradient_edited_in_stage1_raises_before_any_update(two_ranks):
    for results in two_ranks:
        message, unchanged = case_result(results, ("local edit", 1))
        assert message.startswith("RuntimeError") and "modified in place between backward and step" in message
        assert "param.grad after backward" in message and unchanged


def test_a_deleted_optimizer_can_be_replaced_and_a_refused_one_breaks_nothing(two_ranks):
    for results in two_ranks:
        refused, first_still_trains, rebuilt = case_result(results, "rebuild")
        assert "already managed by another ShardedOptimizer" in refused
        assert first_still_trains and rebuilt == "no error"


def test_an_old_format_state_dict_is_refused_clearly(two_ranks):
    for results in two_ranks:
        message = case_result(results, "old state dict")
        assert message.startswith("ValueError") and "older zeroimpl" in message


def test_a_scalar_parameter_converts_from_torch_and_saves(two_ranks):
    for results in two_ranks:
        assert case_result(results, "scalar parameter") == "no error"
