"""accelerate's loop with ``zeroimpl.integrations.accelerate.prepare`` against accelerate's own DDP path
(``accelerator.prepare(model, torch.optim.AdamW(...), dataloader, scheduler)``): the same tiny GPT-2, data, seed and
loop (``accelerator.accumulate``, ``accelerator.backward``, ``clip_grad_norm_`` / ``clip_grad_value_`` on
synchronising steps, ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``), 2 ranks, gloo, CPU.

* Clipping by value, no accumulation (``"clip value"``): stages 1 and 2 are bitwise DDP's.
* Accumulation over 2 micro-batches with clipping by norm (``"accumulated, clipped"``): the norm is summed in
  another order (per-piece partial sums, then across ranks) and stage 2 reduces each micro-batch (DDP's
  ``no_sync`` sums them first), so norms agree to NORM_RTOL and parameters to ADAM_ATOL (measured below);
  stage 2 with offload (the for-loop AdamW kernel, as DDP's) is bitwise stage 2 without.
* bf16 autocast (``mixed_precision="bf16"``) with accumulation and clipping, stage 2: within BF16_PARAM_RTOL of
  DDP in relative L2 over the parameters (measured below).
* ``accelerator.save_state`` at step SAVE_AT of STEPS, then ``load_state`` into a fresh run (new Accelerator, model,
  ShardedOptimizer, scheduler, dataloader skipping the batches done): bitwise the uninterrupted run, for the
  accumulated, clipped runs of stage 2 and offload and for bf16.

On a CPU-only machine ``Accelerator()`` under torchrun's environment does not take up the process group: it sees
one process (``DistributedType.NO``), and needs ``cpu=True`` (``accelerate launch --cpu`` sets
ACCELERATE_USE_CPU) to see both ranks (``DistributedType.MULTI_CPU``, device ``cpu:0``); ``prepare`` refuses the
first. accelerate keeps its settings in per-process singletons, so each case starts them afresh (``_accelerator``).
"""

import contextlib
import gc
import os

import pytest
import torch

from distributed import case_result, case_results, run_cases, run_distributed
from workloads import SEQUENCE_LENGTH, VOCAB, build_model, param_groups, relative_l2
from zeroimpl import CPUOffload, ShardedOptimizer

STEPS, SAVE_AT, BATCH = 4, 2, 2  # optimizer steps, the step save_state runs after, sequences per micro-batch
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99)}
NORM_RTOL = 1e-6  # measured: 9.8e-8 (stages 1 and 2)
ADAM_ATOL = 1e-4  # as tests/test_optimizer_drop_in_loops.py; measured: 7.5e-9 (stage 1), 5.0e-6 (stage 2)
BF16_PARAM_RTOL = 3e-3  # measured: 6.1e-4 relative L2 (bf16 itself: DDP bf16 against DDP fp32, 9.4e-3)
# name -> (gradient_accumulation_steps, (clip utility, its bound), mixed_precision, zeroimpl configurations)
VARIANTS = {"clip value": (1, ("value", 0.01), "no", ["stage 1", "stage 2"]),
            "accumulated, clipped": (2, ("norm", 0.3), "no", ["stage 1", "stage 2", "offload"]),
            "bf16": (2, ("norm", 0.3), "bf16", ["stage 2"])}
CONFIGS = {"stage 1": dict(stage=1), "stage 2": dict(stage=2),
           "offload": dict(stage=2, offload=CPUOffload(fused_step=False)),
           "plain stage 1": dict(stage=1)}  # accelerator.prepare itself: the model moved to cpu:0 and DDP-wrapped
PLAIN = [("clip value", "plain stage 1"), ("accumulated, clipped", "plain stage 1")]
RESUMED = [("accumulated, clipped", "stage 2"), ("accumulated, clipped", "offload"), ("bf16", "stage 2")]


def _accelerator(**kwargs):
    """A new Accelerator over both ranks (``cpu=True``: see the module docstring), its settings not the last
    case's. accelerate's ``_reset_state`` (no public seam: its own tests start afresh the same way) clears the
    singletons; it leaves the process group alone."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    gc.collect()  # the last case's optimizers let go of their models
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(**{"cpu": True, **kwargs})


def _loader(accumulation: int) -> torch.utils.data.DataLoader:
    """Every step's sequences for both ranks (accelerate gives each rank every other batch), in order."""
    count = STEPS * accumulation * 2 * BATCH
    ids = torch.randint(1, VOCAB, (count, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(11))
    return torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=BATCH)


def _build(variant: str, config):
    """A fresh accelerator and the four objects, prepared: by accelerate with DDP (``config`` None) or by zeroimpl."""
    from zeroimpl.integrations.accelerate import prepare

    accumulation, _, precision, _ = VARIANTS[variant]
    accelerator = _accelerator(gradient_accumulation_steps=accumulation, mixed_precision=precision)
    model = build_model("gpt2")
    if config is None:
        optimizer = torch.optim.AdamW(param_groups(model), **ADAMW)
    else:
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, bucket_numel=4096, **CONFIGS[config],
                                     **ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    objects = (model, optimizer, _loader(accumulation), scheduler)
    plain = config is None or config.startswith("plain")
    prepared = accelerator.prepare(*objects) if plain else prepare(accelerator, *objects)
    return accelerator, model, prepared


def _run(variant: str, config, save_to=None, resume_from=None) -> dict:
    """Train STEPS optimizer steps (from SAVE_AT with ``resume_from``), saving after step SAVE_AT to ``save_to``."""
    accumulation, (clip, bound), _, _ = VARIANTS[variant]
    accelerator, model, (wrapped, optimizer, loader, scheduler) = _build(variant, config)
    checks = {"model is bare": wrapped is model and accelerator.unwrap_model(wrapped) is model,
             "types": [type(o).__name__ for o in (wrapped, optimizer, loader, scheduler)], "batches": len(loader),
             "devices": (str(accelerator.device), str(next(model.parameters()).device))}
    steps = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        loader, steps = accelerator.skip_first_batches(loader, SAVE_AT * accumulation), SAVE_AT
        checks["model.safetensors"] = _saved_weights(resume_from, model)
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(wrapped):
            loss = wrapped(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip == "norm":
                norms.append(accelerator.clip_grad_norm_(wrapped.parameters(), bound).item())
            elif accelerator.sync_gradients:  # the largest gradient element (scaled by 1.0: unchanged), then clip
                largest = accelerator.clip_grad_norm_(wrapped.parameters(), float("inf"), norm_type=float("inf"))
                norms.append(largest.item())
                accelerator.clip_grad_value_(wrapped.parameters(), bound)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        steps += accelerator.sync_gradients
        if accelerator.sync_gradients and steps == SAVE_AT and save_to is not None:
            accelerator.save_state(save_to)
    assert steps == STEPS
    return {"losses": losses, "norms": norms, "lr": scheduler.get_last_lr(), "checks": checks,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _saved_weights(folder: str, model: torch.nn.Module) -> dict:
    """What save_state wrote to ``model.safetensors`` in ``folder``: its names, those of the DDP run's, and whether
    it holds the restored model's values."""
    from safetensors.torch import load_file

    saved, restored = load_file(os.path.join(folder, "model.safetensors")), model.state_dict()
    ddp = load_file(os.path.join(os.path.dirname(folder), "ddp", "model.safetensors"))
    return {"names": sorted(saved), "ddp names": sorted(ddp),
            "restored values": all(torch.equal(tensor, restored[name]) for name, tensor in saved.items())}


def _buffers_broadcast(rank: int, ddp: bool) -> list:
    """A buffer that differs per rank and that each forward moves by the rank's own amount, through a sequence of
    training forwards inside and outside accelerator.no_sync: its values after each, on accelerate's own DDP
    (``ddp``) or zeroimpl's prepare; then the main process alone runs the bare model under no_grad, and every
    rank meets at a barrier (a broadcast from rank 0 alone would hang it)."""
    from zeroimpl.integrations.accelerate import prepare

    accelerator = _accelerator()
    model = build_model("gpt2")
    model.register_buffer("probe", torch.zeros(3))
    model.register_forward_hook(lambda module, args, output: module.probe.add_(rank + 1))
    if ddp:
        model, _ = accelerator.prepare(model, torch.optim.AdamW(param_groups(model), **ADAMW))
    else:
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=1, **ADAMW)
        model, _ = prepare(accelerator, model, optimizer)
    accelerator.unwrap_model(model).probe.fill_(10.0 * (rank + 1))  # as the forwards find it, whatever set-up did
    ids = torch.randint(1, VOCAB, (1, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(rank))
    seen = []
    for phase in ("train", "no_sync", "no_sync", "train", "train", "no_sync", "train"):
        with accelerator.no_sync(model) if phase == "no_sync" else contextlib.nullcontext():
            model(input_ids=ids)
        seen.append(accelerator.unwrap_model(model).probe.tolist())
    if rank == 0:  # the main process alone runs the bare model without gradients (generation, an evaluation)
        with torch.no_grad():
            accelerator.unwrap_model(model)(input_ids=ids)
    accelerator.wait_for_everyone()
    return seen


def _outcome(action) -> str:
    try:
        action()
        return "no error"
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"


def _refusals(shared: str) -> dict:
    """Each misuse: the error this rank raised."""
    from zeroimpl.integrations.accelerate import prepare

    def sharded(model):
        return ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, **ADAMW)

    outcomes = {}
    model = build_model("gpt2")
    outcomes["plain torch optimizer"] = _outcome(
        lambda: prepare(_accelerator(), model, torch.optim.AdamW(param_groups(model), **ADAMW)))
    model = build_model("gpt2")
    optimizer = sharded(model)
    outcomes["Accelerator() without cpu=True"] = _outcome(lambda: prepare(_accelerator(cpu=False), model, optimizer))
    outcomes["without its model"] = _outcome(lambda: prepare(_accelerator(), optimizer))
    os.environ["ACCELERATE_TORCH_DEVICE"] = "meta"  # accelerate's own override of its device: one the model is not on
    try:
        outcomes["model on another device"] = _outcome(lambda: prepare(_accelerator(), model, optimizer))
    finally:
        del os.environ["ACCELERATE_TORCH_DEVICE"]
    accelerator = _accelerator()
    model, optimizer = prepare(accelerator, model, optimizer)
    outcomes["prepared twice"] = _outcome(lambda: prepare(accelerator, model, optimizer.optimizer))
    outcomes["state_dict outside save_state"] = _outcome(optimizer.state_dict)
    # a folder save_state wrote for accelerate's DDP path (by the "accumulated, clipped" reference run)
    outcomes["load_state without shards"] = _outcome(lambda: accelerator.load_state(os.path.join(shared, "ddp")))
    return outcomes


def _plain_accelerate_prepare(rank: int) -> str:
    """``accelerator.prepare(model, sharded_optimizer, ...)``, then one step: the error this rank raised."""
    accelerator = _accelerator()
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, **ADAMW)
    ids = torch.randint(1, VOCAB, (BATCH, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(rank))

    def one_step():
        wrapped, prepared = accelerator.prepare(model, optimizer)
        accelerator.backward(wrapped(input_ids=ids, labels=ids).loss)
        prepared.step()
    return _outcome(one_step)


def _two_models(shared: str) -> dict:
    """A frozen second model (a DPO reference, a teacher) prepared after the trained one: save_state writes it to
    ``model_1.safetensors``, and load_state into fresh models must restore each from its own file, the trained one
    from its shards (accelerate names the files by the models' positions)."""
    from zeroimpl.integrations.accelerate import prepare

    folder, out = os.path.join(shared, "two models"), {}
    for phase, shift in (("saved", 1.0), ("loaded", 2.0)):  # the fresh reference differs from the saved one
        accelerator = _accelerator()
        model, reference = build_model("gpt2"), build_model("gpt2").requires_grad_(False)
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(shift)
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, **ADAMW)
        model, optimizer = prepare(accelerator, model, optimizer)
        reference = accelerator.prepare_model(reference, evaluation_mode=True)  # as TRL prepares a reference model
        if phase == "saved":
            accelerator.backward(model(**next(iter(_loader(1)))).loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.save_state(folder)
        else:
            accelerator.load_state(folder)
        out[phase] = [{name: p.detach().clone() for name, p in m.named_parameters()} for m in (model, reference)]
    return {"restored": all(torch.equal(saved[name], loaded[name]) for saved, loaded in zip(out["saved"], out["loaded"])
                            for name in saved)}


def _two_optimizers(shared: str) -> dict:
    """Two models of one shape, each with its own ShardedOptimizer (another learning rate), in one Accelerator:
    a step, save_state, a second step (the uninterrupted run); then fresh models and optimizers, load_state and
    the second step: each optimizer must resume from its own shards, not the other's."""
    from zeroimpl.integrations.accelerate import prepare

    folder, after = os.path.join(shared, "two optimizers"), {}
    batch = next(iter(_loader(1)))
    for phase, seed in (("uninterrupted", 0), ("resumed", 1)):
        accelerator = _accelerator()
        torch.manual_seed(seed)
        models = [build_model("gpt2"), build_model("gpt2")]
        optimizers = [ShardedOptimizer(param_groups(m), torch.optim.AdamW, **{**ADAMW, "lr": lr})
                      for m, lr in zip(models, (1e-2, 3e-3))]
        prepared = prepare(accelerator, models[0], optimizers[0], models[1], optimizers[1])
        models, optimizers = prepared[0::2], prepared[1::2]
        steps = ("first", "save", "second") if phase == "uninterrupted" else ("load", "second")
        for action in steps:
            if action == "save":
                accelerator.save_state(folder)
            elif action == "load":
                accelerator.load_state(folder)
            else:
                for model, optimizer in zip(models, optimizers):
                    accelerator.backward(model(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
        after[phase] = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
    return {"subdirs": [o.checkpoint_subdir for o in optimizers],
            "resumed as uninterrupted": all(torch.equal(u[n], r[n]) for u, r in zip(after["uninterrupted"],
                                                                                     after["resumed"]) for n in u)}


def _all(rank, world_size, shared):
    cases = {}
    for variant, (_, _, _, configs) in VARIANTS.items():
        save_reference = os.path.join(shared, "ddp") if variant == "accumulated, clipped" else None
        cases[("run", variant, "ddp")] = lambda v=variant, s=save_reference: _run(v, None, save_to=s)
        for config in configs:
            folder = os.path.join(shared, f"{variant}-{config}")
            cases[("run", variant, config)] = lambda v=variant, c=config, f=folder: _run(v, c, save_to=f)
    for variant, config in PLAIN:
        cases[("run", variant, config)] = lambda v=variant, c=config: _run(v, c)
    cases["plain save_state"] = lambda: _outcome(lambda: _run("clip value", "plain stage 1",
                                                              save_to=os.path.join(shared, "plain")))
    for variant, config in RESUMED:
        folder = os.path.join(shared, f"{variant}-{config}")
        cases[("resume", variant, config)] = lambda v=variant, c=config, f=folder: _run(v, c, resume_from=f)
    cases["buffers"] = lambda: _buffers_broadcast(rank, ddp=False)
    cases["buffers under ddp"] = lambda: _buffers_broadcast(rank, ddp=True)
    cases["refusals"] = lambda: _refusals(shared)
    cases["two models"] = lambda: _two_models(shared)
    cases["two optimizers"] = lambda: _two_optimizers(shared)
    cases["plain accelerate prepare"] = lambda: _plain_accelerate_prepare(rank)  # last: it leaves a DDP wrapper
    return run_cases(cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(2, _all, str(tmp_path_factory.mktemp("accelerate")))


def _bitwise(a: dict, b: dict) -> bool:
    return (a["losses"] == b["losses"] and a["norms"] == b["norms"] and a["lr"] == b["lr"]
            and all(torch.equal(a["params"][name], b["params"][name]) for name in a["params"]))


def _max_param_diff(a: dict, b: dict) -> float:
    return max((a["params"][name] - b["params"][name]).abs().max().item() for name in a["params"])


@pytest.mark.parametrize("config", VARIANTS["clip value"][3])
def test_bitwise_ddp_without_accumulation(ranks, config):
    for got, expected in zip(case_results(ranks, ("run", "clip value", config)),
                             case_results(ranks, ("run", "clip value", "ddp"))):
        assert _bitwise(got, expected), f"max parameter difference {_max_param_diff(got, expected):.3g}"
        assert max(expected["norms"]) > VARIANTS["clip value"][1][1], "the test must clip"


@pytest.mark.parametrize("config", VARIANTS["accumulated, clipped"][3])
def test_accumulated_and_clipped_within_tolerance_of_ddp(ranks, config):
    for got, expected in zip(case_results(ranks, ("run", "accumulated, clipped", config)),
                             case_results(ranks, ("run", "accumulated, clipped", "ddp"))):
        assert got["lr"] == expected["lr"]
        assert len(got["losses"]) == len(expected["losses"]) == STEPS * 2
        assert got["losses"][:2] == expected["losses"][:2], "the first step's losses come before any update"
        for norm, reference in zip(got["norms"], expected["norms"]):
            assert abs(norm - reference) <= NORM_RTOL * reference
        assert any(norm > 0.3 for norm in expected["norms"]), "the test must clip"
        assert _max_param_diff(got, expected) <= ADAM_ATOL


@pytest.mark.parametrize("variant", [variant for variant, _ in PLAIN])
def test_accelerator_prepare_itself_trains_a_stage_1_sharded_optimizer_bitwise_as_ddp(ranks, variant):
    """accelerator.prepare(model, ShardedOptimizer(stage=1), loader, scheduler): accelerate moves the model to cpu:0
    (followed: nothing was stepped yet) and wraps it in DDP, which averages the gradients (accumulate() is its
    no_sync, clip_grad_norm_ torch's on DDP's full gradients): bitwise DDP + AdamW, with and without accumulation."""
    for got, expected in zip(case_results(ranks, ("run", variant, "plain stage 1")),
                             case_results(ranks, ("run", variant, "ddp"))):
        assert got["checks"]["types"][0] == "DistributedDataParallel"
        assert _bitwise(got, expected), f"max parameter difference {_max_param_diff(got, expected):.3g}"


def test_save_state_on_accelerator_prepares_route_is_refused_at_save_time_on_every_rank(ranks):
    """accelerate's save_state writes the main process's optimizer.state_dict() alone: under DDP that is refused (as
    torch's ZeroRedundancyOptimizer refuses it unconsolidated), never a checkpoint holding one rank's shard."""
    for outcome in case_results(ranks, "plain save_state"):
        assert outcome.startswith("RuntimeError: ") and "consolidate_state_dict(to=0)" in outcome, outcome
        assert "zeroimpl.integrations.accelerate.prepare" in outcome


def test_offload_is_bitwise_stage_2(ranks):
    for offload, stage_2 in zip(case_results(ranks, ("run", "accumulated, clipped", "offload")),
                                case_results(ranks, ("run", "accumulated, clipped", "stage 2"))):
        assert _bitwise(offload, stage_2)


def test_bf16_autocast_within_tolerance_of_ddp(ranks):
    for got, expected in zip(case_results(ranks, ("run", "bf16", "stage 2")),
                             case_results(ranks, ("run", "bf16", "ddp"))):
        assert got["lr"] == expected["lr"]
        assert relative_l2(got["params"], expected["params"]) <= BF16_PARAM_RTOL
    fp32 = case_results(ranks, ("run", "accumulated, clipped", "ddp"))[0]
    bf16 = case_results(ranks, ("run", "bf16", "ddp"))[0]
    assert not _bitwise(bf16, fp32), "bf16 autocast must be on"


@pytest.mark.parametrize("variant, config", RESUMED)
def test_save_state_then_load_state_continues_bitwise(ranks, variant, config):
    for resumed, uninterrupted in zip(case_results(ranks, ("resume", variant, config)),
                                      case_results(ranks, ("run", variant, config))):
        accumulation = VARIANTS[variant][0]
        assert resumed["losses"] == uninterrupted["losses"][SAVE_AT * accumulation:]
        assert resumed["norms"] == uninterrupted["norms"][SAVE_AT:]
        assert resumed["lr"] == uninterrupted["lr"]
        assert all(torch.equal(resumed["params"][n], uninterrupted["params"][n]) for n in resumed["params"])
        saved = resumed["checks"]["model.safetensors"]  # whole, not one tensor per flat bucket
        assert saved["names"] == saved["ddp names"] and saved["restored values"]


def test_load_state_restores_every_model_from_its_own_file(ranks):
    for result in case_results(ranks, "two models"):
        assert result == {"restored": True}


def test_two_optimizers_of_one_accelerator_each_resume_from_their_own_shards(ranks):
    """Two same-shape models with their ShardedOptimizers (another lr each) in one Accelerator: save_state writes
    each optimizer's shards to a folder of its own, and load_state continues both bitwise as the uninterrupted run."""
    for result in case_results(ranks, "two optimizers"):
        assert result == {"subdirs": ["zeroimpl", "zeroimpl_1"], "resumed as uninterrupted": True}


def test_returns_what_accelerate_prepare_returns_without_ddp(ranks):
    for got, expected in zip(case_results(ranks, ("run", "clip value", "stage 2")),
                             case_results(ranks, ("run", "clip value", "ddp"))):
        model, optimizer, loader, scheduler = got["checks"]["types"]
        assert got["checks"]["model is bare"] and model == "GPT2LMHeadModel"
        assert expected["checks"]["types"][0] == "DistributedDataParallel"
        assert optimizer == "AcceleratedShardedOptimizer"  # an AcceleratedOptimizer subclass
        assert [loader, scheduler] == expected["checks"]["types"][2:] == ["DataLoaderShard", "AcceleratedScheduler"]
        assert got["checks"]["batches"] == expected["checks"]["batches"] == STEPS  # each rank every other batch
        assert got["checks"]["devices"] == ("cpu:0", "cpu"), "accelerate's cpu:0 is the model's cpu: not moved"


def test_rank_0s_buffers_are_broadcast_exactly_when_ddp_broadcasts_them(ranks):
    """Before the first forward, and before a forward that follows one run with gradients outside no_sync: after
    each of a sequence of training forwards, every rank's buffer is what it is under accelerate's own DDP; a
    forward the main process runs alone without gradients communicates nothing."""
    ours, under_ddp = case_results(ranks, "buffers"), case_results(ranks, "buffers under ddp")
    assert ours == under_ddp


@pytest.mark.parametrize("misuse, error, words", [
    ("plain torch optimizer", "TypeError", "takes a zeroimpl.ShardedOptimizer"),
    ("Accelerator() without cpu=True", "ValueError", "Accelerator(cpu=True)"),
    ("without its model", "ValueError", "without the model it trains"),
    ("model on another device", "ValueError", "is on cpu, but the accelerator trains on meta: prepare() does not "
                                              "move a model that a ShardedOptimizer trains. Call "
                                              "model.to(accelerator.device) before prepare()"),
    ("prepared twice", "ValueError", "prepare each model once"),
    ("state_dict outside save_state", "RuntimeError", "accelerator.save_state(dir) on every process"),
    ("load_state without shards", "FileNotFoundError", "no zeroimpl/ folder of zeroimpl shards"),
])
def test_misuse_raises_a_clear_error_on_every_rank(ranks, misuse, error, words):
    for results in case_results(ranks, "refusals"):
        assert results[misuse].startswith(f"{error}: ") and words in results[misuse], results[misuse]


def test_plain_accelerator_prepare_of_a_sharded_optimizer_raises_on_every_rank(ranks):
    for rank_results in ranks:
        outcome = case_result(rank_results, "plain accelerate prepare")
        assert outcome.startswith("RuntimeError: ") and "zeroimpl.integrations.accelerate.prepare" in outcome, outcome
