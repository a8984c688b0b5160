"""The loops people already run, unchanged but for the optimizer line, against DDP + the same torch optimizer.

* nanoGPT's loop (examples/nanogpt_style.py): GradScaler (under fp16 autocast its first steps overflow, so
  both skip the same steps and move the scale alike), ``scaler.unscale_``, ``torch.nn.utils.clip_grad_norm_(
  model.parameters())``, lr set in every group, accumulation, master-only evaluation; stages 1, 2 and 2 with
  offload. Unclipped it is bitwise DDP's (see NANOGPT_VARIANTS). Clipped, the norm is summed in another order
  (per-piece partial sums, then across ranks) and stage 2 reduces each micro-batch (DDP with ``no_sync``
  sums them first), so norms agree to NORM_RTOL = 1e-6, AdamW's parameters to ADAM_ATOL = 1e-4 (as
  tests/test_optimizer_clipping.py) and losses to LOSS_RTOL.
* torch's gradient utilities on ``model.parameters()``: ``clip_grad_norm_`` (norm types 2, 1, 3, inf;
  ``foreach`` on and off), ``get_total_norm`` + ``clip_grads_with_norm_``, ``clip_grad_value_`` (elementwise:
  bitwise), each at the cost of at most one all-reduce; a 16-bit model's norm against the fp32 average of the
  ranks' bf16 gradients (the gradient shard's own precision), within bf16 rounding of the result (2^-8).
* an accelerate-style loop: ``accelerator.backward``, ``accelerator.clip_grad_norm_`` over an unwrapped model.
* the user clearing ``.grad`` (``model.zero_grad()``) between backward and step: forgotten, as torch forgets it.
* a master-only optimizer checkpoint (rank 0's shard handed to every rank) refused on every rank; each rank's
  own state resumes bitwise.
"""

import contextlib
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import case_results, run_cases, run_distributed
from workloads import batch, build_model, example_module, param_groups
from zeroimpl import CPUOffload, ShardedOptimizer

NORM_RTOL = 1e-6
ADAM_ATOL = 1e-4
BF16_RTOL = 2 ** -8
REENTRANT_ATOL = 1e-6  # AdamW, 4 steps, lr 1e-2 (measured: see the test's output)
LOSS_RTOL = 1e-5  # losses after steps whose parameters agree to ADAM_ATOL
LATER_NORM_RTOL = 1e-4  # gradient norms after such steps (measured 8.3e-6)
# offload with the for-loop AdamW kernel, DDP's (the fused CPU kernel rounds differently in the last bit)
ZERO_CONFIGS = {"stage 1": dict(stage=1), "stage 2": dict(stage=2),
                "offload": dict(stage=2, offload=CPUOffload(fused_step=False))}
# name -> (grad_clip, gradient_accumulation_steps, autocast dtype, configurations). Under fp16 autocast only
# bitwise runs compare: a last-bit difference of a parameter flips the rounding of its fp16 copy, and the
# gradients move by fp16 ulps (measured: 6e-3 on the parameters in 5 steps after a clipping norm 1e-7 off, or
# after stage 2's per-micro-batch sums, which differ from DDP's no_sync sum in the last bit). So clipping and
# stage 2's accumulation compare in fp32, with a loss scale that does not overflow.
NANOGPT_VARIANTS = {"fp16 unclipped": (0.0, 1, torch.float16, list(ZERO_CONFIGS)),
                    "fp16 accumulated": (0.0, 2, torch.float16, ["stage 1"]),
                    "fp32 clipped": (1.0, 2, None, list(ZERO_CONFIGS))}


def _nanogpt():
    return example_module("nanogpt_style.py")


def _nanogpt_run(rank, config, grad_clip, iters=5, autocast_dtype=torch.float16, **train_kwargs):
    """nanoGPT's loop under fp16 autocast with a GradScaler whose first scales overflow (skipped steps, backoff)."""
    ng = _nanogpt()
    model = ng.build_model()
    optimizer = ng.configure_optimizers(model, 0.1, 6e-3, (0.9, 0.95), zero_stage=config and config["stage"],
                                        offload=config and config.get("offload"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20 if autocast_dtype else 2.0 ** 16, growth_interval=2)
    wrapped = DDP(model) if config is None else model
    history = ng.train(wrapped, optimizer, ddp=config is None, rank=rank, iters=iters, grad_clip=grad_clip,
                       scaler=scaler, autocast_dtype=autocast_dtype, log=lambda *_: None,
                       **train_kwargs)
    return history, [p.detach().clone() for p in model.parameters()], (model, optimizer, scaler, ng)


def _nanogpt_cases(rank):
    results = {}
    for variant, (grad_clip, accumulation, dtype, names) in NANOGPT_VARIANTS.items():
        reference, reference_params, _ = _nanogpt_run(rank, None, grad_clip, autocast_dtype=dtype,
                                                      gradient_accumulation_steps=accumulation)
        for name in names:
            history, params, _ = _nanogpt_run(rank, ZERO_CONFIGS[name], grad_clip, autocast_dtype=dtype,
                                              gradient_accumulation_steps=accumulation)
            results[(variant, name)] = (history, reference, params, reference_params)
    return results


def _resume(rank, shared):
    """Checkpoint after 2 iterations as the example does (each rank its own optimizer state), resume, and compare
    with an uninterrupted run; then hand rank 0's state to every rank, as a master-only checkpoint does."""
    out = {}
    config = ZERO_CONFIGS["stage 2"]
    _, whole, _ = _nanogpt_run(rank, config, 1.0, iters=4)
    directory = os.path.join(shared, "nanogpt")
    os.makedirs(directory, exist_ok=True)
    _nanogpt_run(rank, config, 1.0, iters=2, checkpoint_at=2, out_dir=directory)
    _, _, (model, optimizer, scaler, ng) = _nanogpt_run(rank, config, 1.0, iters=0)
    start = ng.load_checkpoint(model, optimizer, scaler, directory, rank, ddp=False)
    ng.train(model, optimizer, ddp=False, rank=rank, iters=4, start_iter=start, scaler=scaler,
             autocast_dtype=torch.float16, log=lambda *_: None)
    out["resumed"] = all(torch.equal(a, b) for a, b in zip(whole, model.parameters()))
    master_only = torch.load(os.path.join(directory, "optimizer.rank0.pt"), weights_only=False)
    try:
        optimizer.load_state_dict(master_only)
        out["master only"] = "no error"
    except Exception as error:  # noqa: BLE001 - the message is the result
        out["master only"] = f"{type(error).__name__}: {error}"
    optimizer.verify_ranks_agree()  # a collective: no rank went on alone, the parameters still agree
    return out


UTILITIES = {
    "clip l2": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.3),
    "clip l1 foreach": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 3.0, norm_type=1.0, foreach=True),
    "clip l3 no foreach": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, norm_type=3.0, foreach=False),
    "clip inf": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01, norm_type="inf"),
    "total then clip": lambda ps: _total_then_clip(list(ps)),
    "clip value": lambda ps: torch.nn.utils.clip_grad_value_(ps, 2e-3),
}


def _total_then_clip(params):
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, 0.3, norm)
    return norm


def _utility_run(rank, config, utility, steps=3):
    """AdamW, two micro-batches per step, the utility between backward and step; returns norms, params and, per
    step, how many all-reduces the utility issued and how many the step issued after it."""
    model = build_model("gpt2")
    if config is None:
        forward, optimizer = DDP(model), torch.optim.AdamW(param_groups(model), lr=1e-2)
    else:
        forward, optimizer = model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, bucket_numel=4096,
                                                     lr=1e-2, **config)
    norms, calls = [], []
    real = dist.all_reduce
    counted = []
    for step in range(steps):
        with forward.no_sync() if config is None else contextlib.nullcontext():
            forward(**batch(rank, step, 0)).loss.backward()
        forward(**batch(rank, step, 1)).loss.backward()
        dist.all_reduce = lambda *args, **kwargs: counted.append(1) or real(*args, **kwargs)
        try:
            norm = UTILITIES[utility](model.parameters())
        finally:
            dist.all_reduce = real
        norms.append(None if norm is None else norm.item())
        utility_calls = len(counted)
        dist.all_reduce = lambda *args, **kwargs: counted.append(1) or real(*args, **kwargs)
        try:
            optimizer.step()
        finally:
            dist.all_reduce = real
        calls.append((utility_calls, len(counted) - utility_calls))
        counted.clear()
        optimizer.zero_grad()
    return norms, [p.detach().clone() for p in model.parameters()], calls


def _utility_cases(rank):
    results = {}
    for utility in UTILITIES:
        reference = _utility_run(rank, None, utility)
        for name, config in ZERO_CONFIGS.items():
            results[("utility", utility, name)] = (_utility_run(rank, config, utility), reference)
    return results


def _bf16_norm(rank):
    """A bf16 model: torch's norm of the sharded gradients against the fp32 average of the ranks' bf16 gradients."""
    out = {}
    for name, config in ZERO_CONFIGS.items():
        model = build_model("gpt2", torch.bfloat16)
        local = build_model("gpt2", torch.bfloat16)
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, **config)
        model(**batch(rank, 0, 0)).loss.backward()
        local(**batch(rank, 0, 0)).loss.backward()
        averaged = []
        for p in local.parameters():
            if p.grad is not None:
                grad = p.grad.float()
                dist.all_reduce(grad)
                averaged.append(grad / dist.get_world_size())
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in averaged])).item()
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        out[name] = (got.item(), got.dtype, expected)
        optimizer.zero_grad()
    return out


def _accelerate_run(rank, config):
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = build_model("gpt2")
    if config is None:
        forward, optimizer = DDP(model), torch.optim.AdamW(param_groups(model), lr=1e-2)
    else:
        forward, optimizer = model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, **config)
    norms = []
    for step in range(3):
        for micro in range(2):
            accelerator.backward(forward(**batch(rank, step, micro)).loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.3).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, [p.detach().clone() for p in model.parameters()]


def _cleared_between_backward_and_step(rank, config):
    """``model.zero_grad()`` after one backward, then another backward and the step: torch steps on the second
    backward's gradients alone."""
    model = build_model("gpt2")
    if config is None:
        forward, optimizer = DDP(model), torch.optim.AdamW(param_groups(model), lr=1e-2)
    else:
        forward, optimizer = model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, **config)
    for step in range(2):
        forward(**batch(rank, step, 0)).loss.backward()
        model.zero_grad()
        forward(**batch(rank, step, 1)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _under_join(rank, stage, batches, ddp=False, join=True):
    """``with Join([optimizer])`` over this rank's number of batches (``ddp``: stage 1 under DDP, ``Join([ddp_model,
    optimizer])`` as torch documents for its ZeroRedundancyOptimizer; ``join=False``: no Join): the error each rank
    raised (or "no error") and the final parameters."""
    from torch.distributed.algorithms.join import Join

    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2)
    forward = DDP(model) if ddp else model
    try:
        with Join([forward, optimizer] if ddp else [optimizer]) if join else contextlib.nullcontext():
            for step in range(batches):
                forward(**batch(rank, step, 0)).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        outcome = "no error"
    except Exception as error:  # noqa: BLE001 - the message is the result
        outcome = f"{type(error).__name__}: {error}"
    return outcome, [p.detach().clone() for p in model.parameters()]


def _utility_free_run(rank, stage):
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2)
    for step in range(3):
        model(**batch(rank, step, 0)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


class SharedInTwoRegions(torch.nn.Module):
    """One layer applied in two reentrant-checkpointed regions: its gradient arrives in two nested backwards."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.shared, self.head = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.head(h).square().mean()


def _shared_in_two_regions(rank, stage):
    model = SharedInTwoRegions()
    if stage is None:
        forward, optimizer = DDP(model, static_graph=True), torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        forward, optimizer = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
    for step in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        forward(x).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


UNSUPPORTED_ON_A_SHARDED_GRADIENT = {  # a debugging read or edit of param.grad (a 2-D weight's)
    "an unsupported operation": lambda grad: grad.abs(),
    "a norm over a dimension": lambda grad: grad.norm(dim=1),
    "a product by a tensor of one value per element": lambda grad: grad.mul_(torch.ones(grad.shape)),
}


def _unsupported(rank, shared, stage):
    """Each of UNSUPPORTED_ON_A_SHARDED_GRADIENT on rank 0 alone: what it raised. Rank 1 runs no collective
    meanwhile, and waits for rank 0 to be done (a file, not a collective). Stage 1 reduces the gradients at the
    first gradient operation: that reduction must not start before the refusal."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2)
    model(**batch(rank, 0, 0)).loss.backward()
    done, message = os.path.join(shared, f"unsupported read done, stage {stage}"), None
    if rank == 0:
        message = {}
        for name, operation in UNSUPPORTED_ON_A_SHARDED_GRADIENT.items():
            try:
                operation(next(model.parameters()).grad)
                message[name] = "no error"
            except Exception as error:  # noqa: BLE001 - the test checks which error
                message[name] = f"{type(error).__name__}: {error}"
        open(done, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    optimizer.zero_grad()
    return message


def _all(rank, world_size, shared):
    cases = {"nanogpt": lambda: _nanogpt_cases(rank), "utilities": lambda: _utility_cases(rank),
             "bf16": lambda: _bf16_norm(rank), "resume": lambda: _resume(rank, shared),
             ("unsupported", 1): lambda: _unsupported(rank, shared, 1),
             ("unsupported", 2): lambda: _unsupported(rank, shared, 2)}
    for stage in (None, 1, 2):
        cases[("shared regions", stage)] = lambda stage=stage: _shared_in_two_regions(rank, stage)
    for stage in (1, 2):
        for fewer in (0, 1):  # the rank with the fewer batches: each of them
            cases[("uneven", stage, fewer)] = lambda stage=stage, fewer=fewer: _under_join(
                rank, stage, 3 if rank == fewer else 5)[0]
        cases[("even", stage)] = lambda stage=stage: (_under_join(rank, stage, 3)[1],
                                                      _utility_free_run(rank, stage))
    for fewer in (0, 1):
        cases[("uneven", "ddp", fewer)] = lambda fewer=fewer: _under_join(rank, 1, 3 if rank == fewer else 5, True)[0]
    cases[("even", "ddp")] = lambda: (_under_join(rank, 1, 3, ddp=True), _under_join(rank, 1, 3, ddp=True, join=False))
    for name, config in [("ddp", None), *ZERO_CONFIGS.items()]:
        cases[("accelerate", name)] = lambda config=config: _accelerate_run(rank, config)
        cases[("cleared", name)] = lambda config=config: _cleared_between_backward_and_step(rank, config)
    return run_cases(cases)  # one case failing must not hide the others


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(2, _all, str(tmp_path_factory.mktemp("drop_in")))


@pytest.mark.parametrize("variant, config", [(v, c) for v, (_, _, _, configs) in NANOGPT_VARIANTS.items()
                                             for c in configs])
def test_nanogpt_loop_trains_as_ddp(ranks, variant, config):
    grad_clip, _, dtype, _ = NANOGPT_VARIANTS[variant]
    for results in case_results(ranks, "nanogpt"):
        history, reference, params, reference_params = results[(variant, config)]
        scales = [scale for _, _, scale in history]
        assert scales == [scale for _, _, scale in reference], "the same steps skipped, the same scales"
        if dtype is not None:
            assert scales[0] < 2.0 ** 20, "the test must overflow at first (a skipped step)"
        first_stepped = True
        for (loss, norm, _), (expected_loss, expected, _) in zip(history, reference):
            assert abs(loss - expected_loss) <= LOSS_RTOL * expected_loss
            if math.isnan(expected) or math.isinf(expected):  # not clipped, or a skipped step
                assert norm == expected or (math.isnan(norm) and math.isnan(expected))
                continue
            # the first step's norm is of the same gradients; later ones of parameters within ADAM_ATOL
            assert abs(norm - expected) <= (NORM_RTOL if first_stepped else LATER_NORM_RTOL) * expected
            first_stepped = False
        if not grad_clip:
            assert [loss for loss, _, _ in history] == [loss for loss, _, _ in reference]
            assert all(torch.equal(a, b) for a, b in zip(params, reference_params))
        assert max((a - b).abs().max().item() for a, b in zip(params, reference_params)) <= ADAM_ATOL


@pytest.mark.parametrize("config", list(ZERO_CONFIGS))
@pytest.mark.parametrize("utility", list(UTILITIES))
def test_torch_gradient_utilities_act_on_the_averaged_gradient(ranks, utility, config):
    for results in case_results(ranks, "utilities"):
        (norms, params, calls), (expected_norms, expected_params, _) = results[("utility", utility, config)]
        # the step's checks ride on the norm's all-reduce (the verdict stands across clipping's multiplication)
        assert all(in_utility <= 1 for in_utility, _ in calls), f"at most one all-reduce per call, got {calls}"
        assert all(sum(counts) == 1 for counts in calls), f"one all-reduce per step in all, got {calls}"
        if utility == "clip value":
            if config == "stage 1":
                assert all(torch.equal(a, b) for a, b in zip(params, expected_params))
            assert max((a - b).abs().max().item() for a, b in zip(params, expected_params)) <= ADAM_ATOL
            continue
        for norm, expected in zip(norms, expected_norms):
            assert abs(norm - expected) <= NORM_RTOL * expected
        assert any(n > {"clip l2": 0.3, "clip l1 foreach": 3.0, "clip l3 no foreach": 0.05, "clip inf": 0.01,
                        "total then clip": 0.3}[utility] for n in expected_norms), "the test must clip"
        assert max((a - b).abs().max().item() for a, b in zip(params, expected_params)) <= ADAM_ATOL


@pytest.mark.parametrize("config", list(ZERO_CONFIGS))
def test_a_16bit_models_norm_is_the_norm_of_its_averaged_gradient(ranks, config):
    for results in case_results(ranks, "bf16"):
        norm, dtype, expected = results[config]
        assert dtype == torch.bfloat16
        assert abs(norm - expected) <= BF16_RTOL * expected


@pytest.mark.parametrize("config", list(ZERO_CONFIGS))
def test_an_accelerate_style_loop_trains_as_ddp(ranks, config):
    for got, expected in zip(case_results(ranks, ("accelerate", config)), case_results(ranks, ("accelerate", "ddp"))):
        norms, params = got
        for norm, reference in zip(norms, expected[0]):
            assert abs(norm - reference) <= NORM_RTOL * reference
        assert max((a - b).abs().max().item() for a, b in zip(params, expected[1])) <= ADAM_ATOL


@pytest.mark.parametrize("config", list(ZERO_CONFIGS))
def test_gradients_cleared_by_the_user_are_forgotten_as_in_torch(ranks, config):
    for got, expected in zip(case_results(ranks, ("cleared", config)), case_results(ranks, ("cleared", "ddp"))):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_master_only_checkpoint_is_refused_on_every_rank_and_own_states_resume_bitwise(ranks):
    for rank, results in enumerate(case_results(ranks, "resume")):
        assert results["resumed"]
        message = results["master only"]
        if rank == 0:  # its own state: refused because rank 1 refuses
            assert message.startswith("ValueError: rank 1 (in all-gather order) refused its optimizer state"), message
        assert "saved by rank 0" in message and "save optimizer.state_dict() on every rank" in message


@pytest.mark.parametrize("stage", [1, 2])
def test_an_unsupported_operation_on_a_sharded_gradient_raises_at_once_naming_the_alternatives(ranks, stage):
    """On one rank alone, with no collective on the other: it raises before any collective of its own (which
    would wait for the other rank until the timeout)."""
    on_rank_0, on_rank_1 = case_results(ranks, ("unsupported", stage))
    assert on_rank_1 is None and all(message.startswith("RuntimeError: ") for message in on_rank_0.values())
    unsupported = on_rank_0["an unsupported operation"]
    assert "sharded across the ranks" in unsupported and "clip_grad_norm_" in unsupported
    assert "take the norm of the whole gradient" in on_rank_0["a norm over a dimension"]
    assert "a number or a one-element tensor" in on_rank_0["a product by a tensor of one value per element"]


@pytest.mark.parametrize("fewer", [0, 1], ids=["rank-0-fewer", "rank-1-fewer"])
@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_inputs_under_join_raise_on_every_rank(ranks, stage, fewer):
    """Rank ``fewer`` holds 3 batches, the other 5: both raise at the other's fourth step, naming uneven inputs
    (either rank may run out first: a flag read on one rank only would pass one of the two)."""
    for message in case_results(ranks, ("uneven", stage, fewer)):
        assert message.startswith("UnevenInputsError: uneven inputs"), message
        assert "DistributedSampler" in message


@pytest.mark.parametrize("stage", [1, 2])
def test_even_inputs_under_join_train_as_without_it(ranks, stage):
    for joined, plain in case_results(ranks, ("even", stage)):
        assert all(torch.equal(a, b) for a, b in zip(joined, plain))


@pytest.mark.parametrize("fewer", [0, 1], ids=["rank-0-fewer", "rank-1-fewer"])
def test_join_over_a_ddp_model_and_a_stage_1_optimizer_trains_evenly_and_refuses_uneven_inputs(ranks, fewer):
    """``Join([ddp_model, optimizer])``, torch's idiom for its ZeroRedundancyOptimizer under DDP: even inputs train
    bitwise as without Join; uneven ones raise on every rank."""
    for joined, plain in case_results(ranks, ("even", "ddp")):
        assert joined[0] == plain[0] == "no error"
        assert all(torch.equal(a, b) for a, b in zip(joined[1], plain[1]))
    for message in case_results(ranks, ("uneven", "ddp", fewer)):
        assert message.startswith("UnevenInputsError: uneven inputs"), message


def test_a_layer_in_several_reentrant_checkpointed_regions_trains_as_ddp(ranks):
    """Stage 1 reduces once per step: bitwise. Stage 2 reduces a bucket once per nested backward that brings
    it a gradient (here twice), summed in another order than DDP's one all-reduce: REENTRANT_ATOL."""
    for stage1, stage2, reference in zip(*(case_results(ranks, ("shared regions", s)) for s in (1, 2, None))):
        assert all(torch.equal(a, b) for a, b in zip(stage1, reference))
        worst = max((a - b).abs().max().item() for a, b in zip(stage2, reference))
        print(f"stage 2, a layer in two reentrant regions: {worst:.3g} from DDP")
        assert worst <= REENTRANT_ATOL
