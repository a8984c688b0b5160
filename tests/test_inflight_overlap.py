"""``overlap_param_gather`` (the default): each bucket's parameter all-gather stays in flight after ``step()``
and is waited for by the first torch operation or module forward that touches one of its parameters
(zeroimpl/inflight.py). Results must be bitwise those of ``overlap_param_gather=False`` (the same
collectives, waited for in ``step()``), and every path that reads the parameters in between must see the
new values with no call from the user: a forward (also under ``no_grad`` / ``eval``), checkpoints,
``verify_ranks_agree``, a user's own reads and writes, an extension kernel, TorchScript, torch.func; and the
guard must leave torch's mode stack as it found it.
"""

import io
import os
import time

import pytest
import torch

from distributed import run_distributed
from workloads import (RunConfig, batch, bitwise_equal, build_model, issue_gathers_late_on_rank_1, overlap_pair,
                       param_groups, train)
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.checkpoint import export_fp32_state_dict, save_checkpoint

CASES = {"stage 1": {"stage": 1}, "stage 2": {"stage": 2}, "stage 2 + offload": {"stage": 2, "offload": True},
         "stage 2, accumulation": {"stage": 2, "accum": 2}}


def _runs(rank, world_size):
    results = {}
    for name, case in CASES.items():
        zero_kwargs = {"offload": CPUOffload(fused_step=False)} if case.get("offload") else {}
        for overlap in (False, True):
            config = RunConfig("llama", case["stage"], accum=case.get("accum", 1), clip=(1.0, 2.0),
                               zero_kwargs={**zero_kwargs, "overlap_param_gather": overlap})
            results[(name, overlap)] = train(config)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _runs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_gathers_give_bitwise_the_same_training(runs, case):
    for by_rank in runs:
        assert bitwise_equal(by_rank[(case, True)], by_rank[(case, False)])


def _reads(rank, world_size, root):
    """Two models in lockstep, one with overlapped gathers; after each step, read the parameters every way."""
    models, optimizers = [], []
    for overlap in (False, True):
        model = build_model("gpt2")
        models.append(model)
        optimizers.append(ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                           lr=1e-2, overlap_param_gather=overlap, verify_every=2))
    checks = []
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            model.train()
            optimizer.backward(model(**batch(rank, step, 0)).loss)
            optimizer.step()
            optimizer.zero_grad()
        assert optimizers[1].param_gathers_in_flight or step == 1  # in flight (step 1 verifies: it finishes them)
        with torch.no_grad():  # an evaluation forward right after step()
            outputs = [model.eval()(**batch(rank, 99, 0)).logits for model in models]
        checks.append(torch.equal(*outputs))
    plain, overlapped = models
    optimizers[1].backward(overlapped.train()(**batch(rank, 3, 0)).loss)  # one more step, then a checkpoint
    optimizers[0].backward(plain.train()(**batch(rank, 3, 0)).loss)
    for optimizer in optimizers:
        optimizer.step()
    save_checkpoint(os.path.join(root, "overlapped"), optimizers[1], overlapped)
    exported = export_fp32_state_dict(os.path.join(root, "overlapped"))
    checks.append(all(torch.equal(exported[n], p.detach()) for n, p in plain.named_parameters()))
    optimizers[1].backward(overlapped(**batch(rank, 4, 0)).loss)
    optimizers[0].backward(plain(**batch(rank, 4, 0)).loss)
    for optimizer in optimizers:
        optimizer.step()
    optimizers[1].finish_param_gathers()  # a user's own read
    checks.append(all(torch.equal(a, b) for a, b in zip(plain.parameters(), overlapped.parameters())))
    return checks


def test_every_read_after_step_sees_the_new_parameters(tmp_path):
    for checks in run_distributed(2, _reads, str(tmp_path)):
        assert checks == [True] * len(checks) and len(checks) == 5


def _clone(params):
    return [p.detach().clone() for p in params]


def _ema(params):
    averages = [torch.zeros_like(p, requires_grad=False) for p in params]
    with torch.no_grad():
        for average, p in zip(averages, params):
            average.mul_(0.9).add_(p, alpha=0.1)
    return averages


def _clamp(params):  # a write: a projection after step() (weight clipping), read back later
    with torch.no_grad():
        for p in params:
            p.data.clamp_(-0.05, 0.05)
    return None


def _saved(params):
    buffer = io.BytesIO()
    torch.save(list(params), buffer)
    buffer.seek(0)
    return torch.load(buffer)


USER_READS = {
    "clone": _clone,
    ".data": lambda params: [p.data.clone() for p in params],
    "tolist": lambda params: [torch.tensor(p.tolist()) for p in params],
    "parameters_to_vector": lambda params: [torch.nn.utils.parameters_to_vector(params)],
    "EMA update": _ema,
    "torch.save": _saved,
    "clamp_ after step": _clamp,
}


def _step_both(models, optimizers, rank: int, step: int) -> None:
    """One training step of each model of an :func:`overlap_pair`, on the same batch."""
    for model, optimizer in zip(models, optimizers):
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.step()
        optimizer.zero_grad()


def _user_reads(rank, world_size):
    """After each step, a read or write of the parameters in user code, with no call to finish_param_gathers.
    Rank 1 issues its all-gathers late, so rank 0's are surely still in flight when it reads."""
    issue_gathers_late_on_rank_1(rank)
    models, optimizers = overlap_pair()
    results = {}
    for step, (name, read) in enumerate(USER_READS.items()):
        _step_both(models, optimizers, rank, step)
        if rank == 0:
            assert optimizers[1].param_gathers_in_flight, "rank 0's all-gathers should still be in flight"
        plain, overlapped = (read(list(model.parameters())) for model in models)
        if plain is None:  # a write: compare the parameters once the gathers are done
            optimizers[1].finish_param_gathers()
            plain, overlapped = (list(model.parameters()) for model in models)
        results[name] = all(torch.equal(a, b) for a, b in zip(plain, overlapped))
    for model, optimizer in zip(models, optimizers):  # leave the last gathers in flight: teardown must not hang
        optimizer.backward(model(**batch(rank, 99, 0)).loss)
        optimizer.step()
    return results


def test_a_users_own_read_or_write_after_step_sees_the_new_parameters():
    for results in run_distributed(2, _user_reads):
        assert results == {name: True for name in USER_READS}


@torch.jit.script
def _scripted_copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.clone() for p in params]


def _through_dlpack(params):
    return [torch.from_dlpack(torch.utils.dlpack.to_dlpack(p.data)).clone() for p in params]


def _torch_function_disabled(params):
    with torch._C.DisableTorchFunction():
        return [p.clone() for p in params]


UNSEEN_READS = {
    "a @torch.jit.script function": _scripted_copy,
    "torch.utils.dlpack.to_dlpack": _through_dlpack,
    "under DisableTorchFunction": _torch_function_disabled,
}


def _unseen_reads(rank, world_size):
    """After each step, a read the guard cannot see (docs/advanced.md lists them): before
    finish_param_gathers(), and after it. Rank 1 issues its all-gathers late, so rank 0's are surely in flight."""
    issue_gathers_late_on_rank_1(rank)
    models, optimizers = overlap_pair()
    results = {}
    for step, (name, read) in enumerate(UNSEEN_READS.items()):
        _step_both(models, optimizers, rank, step)
        plain, overlapped = (list(model.parameters()) for model in models)
        expected, before = read(plain), read(overlapped)
        optimizers[1].finish_param_gathers()
        after = read(overlapped)
        results[name] = (all(torch.equal(a, b) for a, b in zip(expected, before)),
                         all(torch.equal(a, b) for a, b in zip(expected, after)))
    return results


def test_the_reads_the_guard_cannot_see_need_finish_param_gathers_first():
    """The documented remedy works for each read below torch's Python dispatch; and on rank 0 (gathers surely in
    flight) each one is stale without it, as the docs say: a read that became visible to the guard fails here,
    and belongs in USER_READS instead."""
    rank0, rank1 = run_distributed(2, _unseen_reads)
    assert rank0 == {name: (False, True) for name in UNSEEN_READS}
    assert all(after for _, after in rank1.values()), rank1


def _guards_after_the_gathers_land(rank, world_size, seconds):
    """After step(), forwards of a module that owns none of the parameters, for up to ``seconds``: what is left
    in flight, and the torch-function modes left on the stack (the guard's: 1 while it stays)."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    optimizer.step()
    in_flight, probe, deadline = optimizer.param_gathers_in_flight, torch.nn.Linear(2, 2), time.monotonic() + seconds
    while optimizer.param_gathers_in_flight and time.monotonic() < deadline:
        probe(torch.zeros(1, 2))
        time.sleep(0.01)
    return in_flight, optimizer.param_gathers_in_flight, torch._C._len_torch_function_stack()


@pytest.mark.parametrize("collectives", ["native", "pairwise"])
def test_the_guards_leave_once_every_gather_has_landed(collectives):
    """Where the backend reports a collective's completion (gloo's own all-gather, as across nodes, and NCCL's),
    the next module forward finishes the gathers that landed, and the guards leave with the last: the rest of
    the forward pays nothing (issue 29). gloo's point-to-point exchanges (the default on one CPU node) do not
    report it: there the guards stay until the forward reads the last bucket."""
    for started, left, modes in run_distributed(2, _guards_after_the_gathers_land, 10.0 if collectives == "native"
                                                else 1.0, env={"ZEROIMPL_COLLECTIVES": collectives}):
        assert started > 1
        assert (left, modes) == ((0, 0) if collectives == "native" else (started, 1))


def _gathers_finished_with_the_guards_lifted(rank, world_size):
    """After step(), zeroimpl's own work with the guards lifted (its gradient reset runs so) finishes the gathers:
    the torch-function modes left on the stack after the block, and the gathers left in flight."""
    from zeroimpl.inflight import guards_lifted

    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    optimizer.step()
    started = optimizer.param_gathers_in_flight
    with guards_lifted():
        optimizer.finish_param_gathers()
    return started, optimizer.param_gathers_in_flight, torch._C._len_torch_function_stack()


def test_a_guard_removed_while_lifted_is_not_put_back():
    """A guard whose gathers all landed while it was lifted leaves for good: none stays on the mode stack, inert,
    making every later torch call pay for its Python handler."""
    for started, left, modes in run_distributed(2, _gathers_finished_with_the_guards_lifted):
        assert started > 0 and (left, modes) == (0, 0)


def _optimizer_freed_by_the_garbage_collector(rank, world_size):
    """An optimizer in a reference cycle (as a framework's wrappers make, Fabric's), dropped with its gathers in
    flight and freed by the garbage collector, whose finalizer lands them. Then a backward that recomputes a
    checkpointed module of another model (its forward runs inside a torch call that torch dispatches through the
    guard), then plain forwards. Returns the gathers that were in flight, whether the collector freed the optimizer,
    the mode stack's depth when the collection started and when it stopped, after the backward, and at the end."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    recomputed = checkpoint(other, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum()
    model = torch.nn.Linear(8, 8)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    optimizer.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    started, freed = optimizer.param_gathers_in_flight, weakref.ref(optimizer.param_sync)
    optimizer.holder = {"optimizer": optimizer}  # the cycle
    del optimizer
    depths = []

    def probe(phase, info):
        depths.append(torch._C._len_torch_function_stack())

    gc.callbacks.append(probe)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(probe)
    recomputed.backward()
    after_backward = torch._C._len_torch_function_stack()
    model(torch.randn(4, 8))
    other(torch.randn(4, 8))
    return started, freed() is None, depths, after_backward, torch._C._len_torch_function_stack()


def test_an_optimizer_freed_by_the_garbage_collector_leaves_the_mode_stack_to_a_forward():
    """The collector may run the finalizer inside any torch call, which saw the guard on the stack: taking it off
    there broke torch's dispatch (TypeError 'no implementation found ... []', or a pop from an empty stack), so the
    collection leaves the stack as it was. The guard leaves at the next forward outside a torch call: one inside a
    call dispatched through the guard (the recompute) cannot take it off, since torch puts it back after the call,
    and must not forget it either (it stayed for good, every torch call paying for it)."""
    for started, freed, depths, after_backward, end in run_distributed(2, _optimizer_freed_by_the_garbage_collector):
        assert started > 0 and freed
        assert depths == [1, 1] and after_backward == 1 and end == 0


def _compiled_step(rank, world_size):
    """A compiled training-step function (fullgraph), the recipe of docs/advanced.md: finish_param_gathers() just
    before it. Returns the graphs dynamo made over 4 steps, and whether the parameters equal those of the same
    model trained without overlap, uncompiled. (A plain torch model: transformers' GPT-2 logs from its forward,
    which fullgraph refuses on its own.)"""
    models, optimizers, graphs = [], [], []
    for overlap in (False, True):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)))
        optimizers.append(ShardedOptimizer(models[-1].parameters(), torch.optim.AdamW, stage=2, bucket_numel=512,
                                           lr=1e-2, overlap_param_gather=overlap))
    plain, overlapped = models

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    @torch.compile(fullgraph=True, backend=counting_backend)
    def loss_of(inputs):
        return overlapped(inputs).pow(2).mean()

    for step in range(4):
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizers[1].finish_param_gathers()
        optimizers[1].backward(loss_of(inputs))
        optimizers[0].backward(plain(inputs).pow(2).mean())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    optimizers[1].finish_param_gathers()
    return len(graphs), all(torch.equal(a, b) for a, b in zip(plain.parameters(), overlapped.parameters()))


def test_a_compiled_training_step_stays_one_graph_after_finish_param_gathers():
    for graphs, same in run_distributed(2, _compiled_step):
        assert graphs == 1 and same


@torch.compile(fullgraph=True, backend="eager")
def _compiled_sgd_update(param, grad, lr):
    param.add_(grad, alpha=-lr)


class _CompiledSGD(torch.optim.SGD):
    """Plain SGD whose update is a function compiled with fullgraph=True, as torchao's optimizers' are."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    _compiled_sgd_update(param, param.grad, group["lr"])


def _compiled_code_beside_gathers(rank, world_size):
    """Two models, each with its optimizer, stepped one after the other (an actor and a critic): the second's
    inner step is compiled code, run while the first's all-gathers are in flight. And a user's function compiled
    with fullgraph=True, run while gathers are in flight: the error. Returns whether the two models trained as
    without overlap, and the error."""
    trained = []
    for overlap in (False, True):
        models, optimizers = [], []
        for cls in (torch.optim.SGD, _CompiledSGD):
            torch.manual_seed(0)
            models.append(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
            optimizers.append(ShardedOptimizer(models[-1].parameters(), cls, stage=2, bucket_numel=512, lr=0.1,
                                               overlap_param_gather=overlap, assume_elementwise=cls is _CompiledSGD))
        for step in range(3):
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
            for model, optimizer in zip(models, optimizers):
                optimizer.backward(model(inputs).pow(2).mean())
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        trained.append([p.detach().clone() for model in models for p in model.parameters()])
    optimizers[0].backward(models[0](inputs).pow(2).mean())
    optimizers[0].step()
    assert optimizers[0].param_gathers_in_flight

    @torch.compile(fullgraph=True, backend="eager")
    def augment(x):
        return (2 * x + 1).tanh()

    try:
        augment(torch.ones(3))
        error = "no error"
    except Exception as raised:  # dynamo's error type: the message is the result
        error = str(raised)
    return all(map(torch.equal, *trained)), error


def test_compiled_code_beside_gathers_in_flight_steps_as_without_overlap_or_names_the_fix():
    """Before: dynamo failed tracing the guard (``UntypedStorage.data_ptr``) in the second optimizer's step, and
    in the user's function with a message that did not say why or what to do."""
    for same, error in run_distributed(2, _compiled_code_beside_gathers):
        assert same
        assert "all-gathers were in flight" in error and "finish_param_gathers()" in error, error


class _KernelLinear(torch.autograd.Function):
    """A linear layer whose kernel runs below torch's Python dispatch, as a C++ extension's or Triton's does
    (torch function modes cannot see it)."""

    @staticmethod
    def forward(x, weight):
        with torch._C.DisableTorchFunction():
            return x @ weight.t()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _KernelNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(64, 32) * 0.1)  # bucket 0, read by the kernel alone
        self.middle = torch.nn.Linear(64, 64)
        self.last = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.middle(torch.tanh(_KernelLinear.apply(x, self.weight)))))


def _data(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=generator), torch.randn(8, 4, generator=generator)


def _loss(model, rank, step):
    x, y = _data(rank, step)
    return ((model(x) - y) ** 2).mean()


def _functional_grads(model, rank):
    x, y = _data(rank, 50)
    loss = lambda p: ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()  # noqa: E731
    return list(torch.func.grad(loss)(dict(model.named_parameters())).values())


READS_BELOW_THE_MODE = {
    "TorchScript": lambda model, rank: [torch.jit.trace(model, _data(rank, 60)[0], check_trace=False)(
        _data(rank, 61)[0])],
    "torch.func.grad": _functional_grads,
    "forward under a user's mode": lambda model, rank: [_under_device_mode(model, rank)],
}


def _under_device_mode(model, rank):
    with torch.device("cpu"):  # a user's TorchFunctionMode entered after step() and left
        return model(_data(rank, 70)[0])


def _module_paths(rank, world_size):
    """Reads that the torch function mode cannot see, each right after a step whose gathers are in flight:
    training through an extension kernel, a TorchScript module, torch.func on the parameters, a forward
    under a user's mode; then two overlapping optimizers at once under torch.set_default_device, and the
    mode stack left as it was."""
    issue_gathers_late_on_rank_1(rank)
    depth = torch._C._len_torch_function_stack()

    def pair():
        models = [_KernelNet() for _ in range(2)]
        return models, [ShardedOptimizer(m.parameters(), torch.optim.AdamW, stage=2, bucket_numel=1024, lr=1e-2,
                                         overlap_param_gather=overlap) for m, overlap in zip(models, (False, True))]

    def train(model, optimizer, steps):
        for step in steps:
            optimizer.backward(_loss(model, rank, step))
            optimizer.step()
            optimizer.zero_grad()

    same = {}
    models, optimizers = pair()
    for model, optimizer in zip(models, optimizers):  # each alone: every forward right after its step()
        train(model, optimizer, range(4))
        optimizer.finish_param_gathers()
    same["training through an extension kernel"] = all(
        torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    for name, read in READS_BELOW_THE_MODE.items():
        models, optimizers = pair()
        outputs = []
        for model, optimizer in zip(models, optimizers):
            train(model, optimizer, range(2))
            outputs.append(read(model, rank))
        same[name] = all(torch.equal(a, b) for a, b in zip(*outputs))

    models, optimizers = pair()
    second = _KernelNet()
    optimizers.append(ShardedOptimizer(second.parameters(), torch.optim.AdamW, stage=2, bucket_numel=1024, lr=1e-2))
    models.append(second)
    in_flight = []
    torch.set_default_device("cpu")  # a DeviceContext at the bottom of the stack for the rest of the run
    try:
        for step in range(3):
            for model, optimizer in zip(models, optimizers):
                train(model, optimizer, [step])
            in_flight.append([o.param_gathers_in_flight for o in optimizers[1:]])
        for model in models:  # an evaluation: every bucket waited for, the guards leave
            model(_data(rank, 80)[0])
        depth_left = torch._C._len_torch_function_stack() - depth - 1  # (the DeviceContext)
    finally:
        torch.set_default_device(None)
    return same, in_flight, depth_left


def test_reads_below_torch_functions_and_the_mode_stack():
    for same, in_flight, depth_left in run_distributed(2, _module_paths):
        assert same == {name: True for name in same}, same
        assert all(counts[0] > 0 and counts[1] > 0 for counts in in_flight), in_flight  # both overlapped
        assert depth_left == 0
