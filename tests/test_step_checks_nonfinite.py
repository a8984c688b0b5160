"""NaN/Inf gradients never reach the parameters, and loss scaling works over fp32 parameters too.

Policy under test (``ShardedOptimizer(nonfinite=...)``): with NaN or Inf in one rank's gradient, every rank
agrees; ``"raise"`` raises FloatingPointError on every rank with parameters and optimizer state untouched,
``"skip"`` skips and counts. A skipped step must leave training exactly where a run that never had that
step would be (bitwise: same Adam step count, same state). Loss scaling by a power of two is exact in fp32,
so fp32 parameters with ``loss_scale=LossScaleConfig(...)`` must train bitwise like no scaling.
"""

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import LossScaleConfig, ShardedOptimizer

BAD_STEP = 1


def _poison_first_element(gradient: torch.Tensor, value: str) -> torch.Tensor:
    """One element only: after the reduce-scatter it lands in one rank's shard, so the other rank's shard is
    finite and only the agreement across ranks can make it skip or raise too."""
    poisoned = gradient.clone()
    poisoned.view(-1)[0] = float(value)
    return poisoned


def _norm(how, optimizer: ShardedOptimizer, model: torch.nn.Module) -> float:
    """The gradient norm before the step, ``how``: False, none; True, ``optimizer.clip_grad_norm_(1.0)``;
    ``"torch"``, torch's ``clip_grad_norm_`` on ``param.grad``; ``"read"``, torch's ``get_total_norm`` only."""
    if how is True:
        return optimizer.clip_grad_norm_(1.0).item()
    if how == "torch":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    if how == "read":
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    return None


# edits of param.grad after the norm was read, at BAD_STEP, on every rank
EDITS = {"nan_to_num": lambda params: [p.grad.nan_to_num_(0.0) for p in params if p.grad is not None],
         "overflow": lambda params: [p.grad.mul_(torch.tensor(1e30)).mul_(torch.tensor(1e30)) for p in params
                                     if p.grad is not None]}


def _train(rank, stage, offload, nonfinite, poison, clip, steps=3, drop_step=None, edit=None, **zero_kwargs):
    """fp32 GPT-2, AdamW; at BAD_STEP one element of rank 1's gradient of one weight is poisoned (nan or inf),
    and ``edit`` (a key of EDITS) applied after the norm (``clip``: see :func:`_norm`).

    ``drop_step``: leave that step out entirely (no backward, no step): the reference for a skipped step.
    Returns per step what happened, and the final parameters and optimizer step counts.
    """
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, offload=offload, lr=1e-2,
                                 bucket_numel=4096, nonfinite=nonfinite, **zero_kwargs)
    target = model.transformer.h[0].mlp.c_fc.weight
    events = []
    for step in range(steps):
        if step == drop_step:
            continue
        handle = None
        if poison is not None and step == BAD_STEP and rank == 1:
            handle = target.register_hook(lambda g: _poison_first_element(g, poison))
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        if handle:
            handle.remove()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        norm = _norm(clip, optimizer, model)
        if edit is not None and step == BAD_STEP:
            EDITS[edit](model.parameters())
        try:
            optimizer.step()
            event = "stepped"
        except FloatingPointError as error:
            event = f"raised: {error}"
        unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        events.append({"event": event, "unchanged": unchanged, "norm": norm,
                       "finite": all(torch.isfinite(p).all().item() for p in model.parameters())})
        optimizer.zero_grad()
    steps_counted = [int(state["step"]) for state in optimizer.inner.state.values()]
    return {"events": events, "skipped": optimizer.skipped_steps, "adam_steps": steps_counted,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


POLICY_CASES = [(1, None, "nan", False), (2, None, "inf", True), (2, "cpu", "nan", True), (1, "cpu", "inf", False),
                (1, None, "inf", "torch"), (2, "cpu", "nan", "torch")]


def _policies(rank, world_size):
    return [{"raise": _train(rank, stage, offload, "raise", poison, clip),
             "skip": _train(rank, stage, offload, "skip", poison, clip),
             "never_had_it": _train(rank, stage, offload, "raise", None, clip, drop_step=BAD_STEP)}
            for stage, offload, poison, clip in POLICY_CASES]


def _all_runs(rank, world_size):
    return {"policies": _policies(rank, world_size), "huge_but_finite": _huge_but_finite(rank, world_size),
            "fp32_scaled": {stage: _fp32_scaled(rank, world_size, stage) for stage in (1, 2)},
            "fp16_at_minimum_scale": _fp16_at_minimum_scale(rank, world_size),
            "edited": {(stage, edit, read): _train(rank, stage, None, "raise", "nan" if edit == "nan_to_num" else None,
                                                   "read" if read else False, edit=edit)
                       for stage in (1, 2) for edit in EDITS for read in (False, True)},
            "after_the_norm": {(stage, case): _after_the_norm(rank, stage, case) for stage, case in AFTER_THE_NORM}}


@pytest.fixture(scope="module")
def runs():
    """Every case of this file in one launch of 2 ranks (each builds its own model and optimizer)."""
    return run_distributed(2, _all_runs)


@pytest.fixture(scope="module")
def policy_runs(runs):
    return [by_rank["policies"] for by_rank in runs]


@pytest.mark.parametrize("case", range(len(POLICY_CASES)))
def test_nonfinite_gradients_raise_or_skip_on_every_rank(policy_runs, case):
    stage, offload, poison, clip = POLICY_CASES[case]
    for result in (per_rank[case] for per_rank in policy_runs):
        raised = result["raise"]["events"]
        assert raised[BAD_STEP]["event"].startswith("raised: the averaged gradients hold NaN or Inf")
        assert "nonfinite='skip'" in raised[BAD_STEP]["event"]
        assert raised[BAD_STEP]["unchanged"]
        assert [e["event"] for i, e in enumerate(raised) if i != BAD_STEP] == ["stepped", "stepped"]
        skipped = result["skip"]
        assert [e["event"] for e in skipped["events"]] == ["stepped"] * 3
        assert skipped["events"][BAD_STEP]["unchanged"] and skipped["skipped"] == 1
        assert all(e["finite"] for e in skipped["events"] + raised)
        if clip:  # the norm of poisoned gradients is reported as such, identically on every rank
            assert not torch.isfinite(torch.tensor(skipped["events"][BAD_STEP]["norm"]))
        reference = result["never_had_it"]
        assert skipped["adam_steps"] == reference["adam_steps"] == [2] * len(reference["adam_steps"])
        for name, param in reference["params"].items():  # both policies recover exactly
            assert torch.equal(skipped["params"][name], param), name
            assert torch.equal(result["raise"]["params"][name], param), name


@pytest.mark.parametrize("stage", [1, 2])
def test_an_edit_after_the_norm_is_checked_by_the_step(runs, stage):
    """The norm's all-reduce carries the step's NaN/Inf check, whose verdict stands across torch's clipping (a
    multiplication by at most 1). Any other edit of param.grad after it is checked again by the step: NaN
    replaced by nan_to_num_ steps as without the norm read (bitwise), and finite gradients multiplied into
    overflow raise on every rank, with nothing changed."""
    for edited in (by_rank["edited"] for by_rank in runs):
        cleaned, cleaned_unread = edited[(stage, "nan_to_num", True)], edited[(stage, "nan_to_num", False)]
        assert [e["event"] for e in cleaned["events"]] == ["stepped"] * 3
        for name, param in cleaned_unread["params"].items():
            assert torch.equal(cleaned["params"][name], param), name
        for read in (True, False):
            events = edited[(stage, "overflow", read)]["events"]
            assert events[BAD_STEP]["event"].startswith("raised: the averaged gradients hold NaN or Inf")
            assert events[BAD_STEP]["unchanged"]


def _after_the_norm(rank, stage, case):
    """A step whose norm was read through param.grad (torch's clip_grad_norm_), then: ``"cleared"``, the user
    clears every param.grad (torch then steps nothing); ``"set_nan"`` (stage 1), a NaN gradient set by hand;
    ``"factor_reused"``, the gradients multiplied into overflow by a factor tensor later set to 0.5;
    ``"factor_data"``, multiplied by a factor of 0.5, which is then set to 1e30 through ``.data`` (no version bump)
    and multiplies them into overflow; ``"inference_factor"``, multiplied by 0.5 made under ``inference_mode``
    (a tensor without a version counter). Returns what the step did and whether the parameters changed."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-2, bucket_numel=4096)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if case == "cleared":
        model.zero_grad()
    elif case == "set_nan":
        target = model.transformer.h[0].mlp.c_fc.weight
        target.grad = torch.full_like(target, float("nan"))
    elif case == "factor_reused":
        factor = torch.tensor(1e30)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor).mul_(factor)
        factor.fill_(0.5)
    elif case == "factor_data":
        factor = torch.tensor(0.5)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for grad in grads:
            grad.mul_(factor)
        factor.data.fill_(1e30)
        for grad in grads:
            grad.mul_(factor).mul_(factor)
    else:
        with torch.inference_mode():
            factor = torch.tensor(0.5)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        optimizer.step()
        event = "stepped"
    except FloatingPointError:
        event = "raised"
    optimizer.zero_grad()
    return event, all(torch.equal(before[n], p) for n, p in model.named_parameters())


AFTER_THE_NORM = [(1, "cleared"), (2, "cleared"), (1, "set_nan"), (2, "factor_reused"), (1, "factor_data"),
                  (2, "inference_factor")]


@pytest.mark.parametrize("stage, case", AFTER_THE_NORM)
def test_what_changed_after_the_norm_decides_the_step(runs, stage, case):
    """The step reuses the norm's check only for the gradients the norm saw: cleared gradients step nothing (as
    torch skips a parameter without .grad), a NaN gradient set by hand after it raises, and a factor is judged by
    the value it multiplied by, not by the value its tensor holds at the step (however it was changed); a factor
    made under inference_mode, which has no version counter, multiplies as any other."""
    for by_rank in runs:
        event, unchanged = by_rank["after_the_norm"][(stage, case)]
        if case == "inference_factor":
            assert event == "stepped" and not unchanged, (stage, case, event)
            continue
        assert unchanged, (stage, case, event)
        assert event == ("stepped" if case == "cleared" else "raised"), (stage, case, event)


def _huge_but_finite(rank, world_size):
    return [_train(rank, stage, None, "raise", "1e20", clip) for stage, clip in ((1, False), (2, True))]


def test_finite_gradients_whose_norm_overflows_are_not_taken_for_nan(runs):
    """NaN/Inf is read off the gradient norm; one finite element of 1e20 overflows the fp32 norm, so the step
    must fall back to the exact check and step, as torch does (clipping then scales by max_norm / inf = 0)."""
    for per_case in (by_rank["huge_but_finite"] for by_rank in runs):
        for clip, result in zip((False, True), per_case):
            assert [e["event"] for e in result["events"]] == ["stepped"] * 3
            assert result["skipped"] == 0 and all(e["finite"] for e in result["events"])
            assert not result["events"][BAD_STEP]["unchanged"]
            if clip:
                assert result["events"][BAD_STEP]["norm"] == float("inf")


def _fp32_scaled(rank, world_size, stage):
    plain = _train(rank, stage, None, "raise", None, True)
    scaled = _train(rank, stage, None, "raise", None, True, loss_scale=LossScaleConfig(initial_scale=2.0 ** 12))
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                 loss_scale=LossScaleConfig())
    try:
        model(**batch(rank, 0, 0)).loss.backward()
        optimizer.step()  # refused where the step prepares, before any of its collectives
        forgotten = None
    except RuntimeError as error:
        forgotten = str(error)
    optimizer.zero_grad()
    return plain, scaled, forgotten


@pytest.mark.parametrize("stage", [1, 2])
def test_loss_scaling_over_fp32_parameters_is_exact(runs, stage):
    """What fp16 autocast over fp32 parameters needs (Trainer fp16): scale, unscale, same result."""
    for plain, scaled, forgotten in (by_rank["fp32_scaled"][stage] for by_rank in runs):
        assert [e["norm"] for e in scaled["events"]] == [e["norm"] for e in plain["events"]]
        for name, param in plain["params"].items():
            assert torch.equal(scaled["params"][name], param), name
        assert "the loss must be scaled: call optimizer.backward(loss)" in forgotten  # not silently tiny


def _fp16_at_minimum_scale(rank, world_size):
    model = build_model("gpt2", torch.float16)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-2,
                                 loss_scale=LossScaleConfig(initial_scale=2.0, min_scale=1.0, hysteresis=1))
    target = model.transformer.h[0].mlp.c_fc.weight
    outcomes = []
    for step in range(3):
        handle = target.register_hook(lambda g: _poison_first_element(g, "inf")) if rank == 0 else None
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        handle and handle.remove()
        try:
            optimizer.step()
            outcomes.append(("skipped", optimizer.loss_scale))
        except FloatingPointError as error:
            outcomes.append(("raised", str(error)))
        optimizer.zero_grad()
    return outcomes, optimizer.skipped_steps


def test_fp16_overflow_at_the_minimum_scale_raises(runs):
    """Overflow is expected while the scale is high; at the minimum it means the gradients really are bad."""
    for outcomes, skipped in (by_rank["fp16_at_minimum_scale"] for by_rank in runs):
        assert outcomes[0] == ("skipped", 1.0)  # 2 -> 1
        assert outcomes[1][0] == "raised" and "minimum loss scale 1.0" in outcomes[1][1]
        assert outcomes[2][0] == "raised" and skipped == 3


@pytest.mark.parametrize("option,value,message", [
    ("nonfinite", "ignore", "nonfinite must be 'raise'"),
    ("loss_scale", "dynamic", "loss_scale must be 'auto'"),
    ("loss_scale", 1024.0, "loss_scale must be 'auto'"),
    ("collective_timeout", float("inf"), "collective_timeout must be None"),
    ("collective_timeout", True, "collective_timeout must be None"),
    ("collective_timeout", 0, "collective_timeout must be None")])
def test_bad_policy_values_are_refused(option, value, message):
    with pytest.raises(ValueError, match=message):
        ShardedOptimizer(torch.nn.Linear(2, 2).parameters(), torch.optim.AdamW, **{option: value})
