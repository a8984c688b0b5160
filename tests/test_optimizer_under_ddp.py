"""The one-line swap: ShardedOptimizer where a torch optimizer (or torch's ZeroRedundancyOptimizer) goes in a DDP
script, against the same script with the torch optimizer, 2 ranks, gloo, fp32.

* PyTorch's DDP tutorial (examples/ddp_tutorial.py: the optimizer built before the model moves to ``cpu:0``,
  which copies it, then DDP's wrap), 3 epochs of SGD and a resume from its model snapshot: stage 1 with DDP
  kept (the one changed line) and stage 2 without DDP (two more), bitwise the tutorial's own run.
* Stage 1 under DDP, AdamW, bitwise DDP + AdamW: plain; ``no_sync()`` accumulation; ``torch.nn.utils.
  clip_grad_norm_`` on DDP's full gradients; ``no_sync()`` with 2 micro-batches on one rank and 1 on the other,
  as DDP allows; a GradScaler with a scale that overflows at first (both skip the same steps); an LR scheduler; CPU
  offload (the for-loop AdamW kernel, as DDP + AdamW's); and the optimizer's own collectives per step: no
  reduction, only the parameters' all-gather (Ψ) and the 5-element check, run afresh at every step, which finds a
  NaN in a piece one rank steps, or in one rank's gradient alone (edited per rank), on every rank.
* Stage 2 under DDP: refused at the first backward, on every rank, naming stage 1 and the unwrapped route.
* Built before the model changes: ``.to(cpu:0)``, ``load_state_dict(assign=True)``, ``.double()`` and
  ``.bfloat16()``, DDP-wrapped or not: bitwise an optimizer built after the change (the documented route); a
  conversion to fp16 turns the automatic loss scaling on, as one built after it has. Built while the parameters are
  out of the collectives' reach (NCCL's condition for a CPU model, patched in on gloo), then moved: bitwise too,
  with a check, a forward on one rank alone and one under inference mode between the move and the first step;
  never moved, the first backward or step raises.
"""

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import case_results, run_cases, run_distributed
from workloads import example_module
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.integrations.collectives import CollectiveCounter, summarize
from zeroimpl import validation
from zeroimpl.validation import PEER_ARGUMENTS



def _tutorial():
    return example_module("ddp_tutorial.py")


def _tutorial_runs(rank, shared):
    """Each optimizer: 3 epochs uninterrupted, and 1 epoch then a resume from the snapshot to 3 (a fresh
    optimizer, as the tutorial's snapshot holds the model only)."""
    os.environ["LOCAL_RANK"] = os.environ["RANK"] = str(rank)
    tutorial = _tutorial()
    out = {}
    for stage in (0, 1, 2):
        snapshot = os.path.join(shared, f"tutorial-{stage}.pt")
        whole = tutorial.run(1, 3, 32, os.path.join(shared, f"unused-{stage}-{rank}.pt"), stage)
        tutorial.run(1, 1, 32, snapshot, stage)
        resumed = tutorial.run(1, 3, 32, snapshot, stage)
        out[stage] = {name: [p.detach().clone() for p in trainer.model.parameters()] + [trainer.losses]
                      for name, trainer in (("whole", whole), ("resumed", resumed))}
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _fit(rank, model, forward, optimizer, steps):
    """``steps`` optimizer steps of ``forward`` (the model, or its DDP wrapper) on this rank's batches, in the model's
    dtype, cross-entropy in fp32; returns the parameters."""
    generator, dtype = torch.Generator().manual_seed(rank), next(model.parameters()).dtype
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = torch.randn(8, 20, generator=generator, dtype=dtype), torch.randint(0, 3, (8,), generator=generator)
        torch.nn.functional.cross_entropy(forward(x).float(), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_run(rank, optimizer_of, accumulate=1, clip=False, scaler=None, steps=5, counter=None, wrap_first=False):
    """AdamW-style training of a DDP-wrapped model: ``optimizer_of(params)``, built before the wrap (or after:
    ``wrap_first``); returns the parameters, the losses and, with ``counter``, zeroimpl's collectives per step.
    ``accumulate``: micro-batches per step, a number or per rank (a tuple)."""
    if isinstance(accumulate, tuple):
        accumulate = accumulate[rank]
    model = _model()
    ddp = DDP(model) if wrap_first else None
    optimizer = optimizer_of(model.parameters())
    ddp = ddp or DDP(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    generator = torch.Generator().manual_seed(rank)
    losses, calls = [], []
    for _ in range(steps):
        if counter is not None:
            counter.take()
        optimizer.zero_grad()
        for micro in range(accumulate):
            x, y = torch.randn(8, 20, generator=generator), torch.randint(0, 3, (8,), generator=generator)
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(ddp(x), y) / accumulate
                (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss.item())
        if scaler:
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        schedule.step()
        if counter is not None:
            calls.append(summarize(counter.take()))
    return [p.detach().clone() for p in model.parameters()], losses, calls


VARIANTS = {"plain": {}, "DDP first": dict(wrap_first=True), "no_sync": dict(accumulate=3),
            "no_sync, uneven": dict(accumulate=(2, 1)), "clip": dict(clip=True),
            "scaler": dict(scaler=True),
            "offload": dict(offload=CPUOffload(fused_step=False))}


def _under_ddp(rank):
    out = {}
    for name, variant in VARIANTS.items():
        options = {k: v for k, v in variant.items() if k not in ("offload", "scaler")}

        def scaler():  # its first scales overflow fp32 gradients: both runs skip those steps and back off alike
            return torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=2) if "scaler" in variant else None

        reference = _ddp_run(rank, lambda ps: torch.optim.AdamW(ps, lr=1e-2), scaler=scaler(), **options)
        zero = _ddp_run(rank, lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, stage=1, lr=1e-2, bucket_numel=500,
                                                          offload=variant.get("offload")), scaler=scaler(), **options)
        out[name] = (reference[:2], zero[:2])
    counter = CollectiveCounter().install()
    try:
        out["collectives"] = _ddp_run(rank, lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, stage=1, lr=1e-2,
                                                                        bucket_numel=500), counter=counter)[2]
    finally:
        counter.uninstall()
    out["psi"] = sum(p.numel() for p in _model().parameters())

    def stage_2():
        model = _model()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
        reached_step = False
        try:
            ddp = DDP(model)  # (held: a wrapper dropped before backward is no wrapper)
            ddp(torch.ones(2, 20)).sum().backward()
            reached_step = True
            optimizer.step()
        except RuntimeError as error:
            return reached_step, str(error)
        return reached_step, None
    out["stage 2"] = stage_2()
    return out


CHANGES = {
    "cpu:0": lambda model: model.to(torch.device("cpu", 0)),
    "assign": lambda model: model.load_state_dict({k: v.clone() for k, v in _model().state_dict().items()},
                                                  assign=True),
    "double": lambda model: model.double(),
    "bfloat16": lambda model: model.bfloat16(),
}


def _changed_run(rank, change, stage, wrap, before):
    """Build the optimizer ``before`` the model change or after it, then train 4 steps."""
    model = _model()
    build = lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2,  # noqa: E731
                                     bucket_numel=500)
    optimizer = build() if before else None
    CHANGES[change](model)
    optimizer = optimizer or build()
    return _fit(rank, model, DDP(model) if wrap else model, optimizer, 4)


@contextlib.contextmanager
def _out_of_reach_until_moved():
    """NCCL's condition for a CPU model, on gloo: the parameters count as out of the collectives' reach
    (``zeroimpl.validation.placement_problem``) until the test says the model moved, as a CPU model's are under
    NCCL until ``.to(its GPU)``; yields a callable that marks the move. tests/test_cuda.py runs the real case."""
    moved = [False]
    original = validation.placement_problem
    validation.placement_problem = lambda params, group: None if moved[0] else "out of reach (moved: no)"
    try:
        yield lambda: moved.__setitem__(0, True)
    finally:
        validation.placement_problem = original


def _moved_into_reach(rank):
    """Built while out of the collectives' reach, then moved (``.to("cpu:0")`` copies), against the optimizer built
    after the move, 3 steps; initial weights differ per rank, so that the construction's broadcast must give rank 0's
    values. Between construction and the first step, as a script may: ``load_state_dict(state_dict())`` before the
    move (accelerate's ``prepare(optimizer, model)``), weights loaded into the model after it; a forward without gradients on rank 0 alone (a sample) then a barrier,
    and a forward under ``torch.inference_mode()`` on every rank (a validation), either first; then
    ``verify_ranks_agree()``. Never moved: the first backward and the step raise."""
    out = {}
    pretrained = {name: value * 0.5 for name, value in _model().state_dict().items()}
    for stage, wrap, offload in ((1, True, None), (1, False, None), (2, False, None), (2, False, "cpu")):
        runs = []
        for before in (True, False):
            with _out_of_reach_until_moved() as move:
                model = _model()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(rank)
                build = lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,  # noqa: E731
                                                 lr=1e-2, bucket_numel=500, offload=offload, collective_timeout=60)
                optimizer = build() if before else None
                if optimizer is not None:  # what accelerate's prepare(optimizer, model) does
                    optimizer.load_state_dict(optimizer.state_dict())
                model.to(torch.device("cpu", 0))
                move()
                model.load_state_dict(pretrained)  # weights loaded after the move, the same on every rank
                optimizer = optimizer or build()
                inference_first = (stage, wrap, offload) in ((1, True, None), (2, False, None))
                for idiom in (("inference", "one rank") if inference_first else ("one rank", "inference")):
                    if idiom == "inference":  # the first forward after the move, on some set-ups
                        with torch.inference_mode():
                            model(torch.ones(2, 20))
                    else:
                        if rank == 0:
                            with torch.no_grad():
                                model(torch.ones(2, 20))
                        dist.barrier()
                optimizer.verify_ranks_agree()
                runs.append(_fit(rank, model, DDP(model) if wrap else model, optimizer, 3))
        out[(stage, wrap, offload)] = runs
    for first in ("backward", "step"):
        with _out_of_reach_until_moved():
            model = _model()
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
            try:
                model(torch.ones(2, 20)).sum().backward() if first == "backward" else optimizer.step()
                out[first] = None
            except (RuntimeError, ValueError) as error:
                out[first] = str(error)
    return out


def _schedule_free_moved_into_reach(rank):
    """A schedule-free optimizer built out of the collectives' reach: ``train()``, which all-gathers the switched
    parameters, raises the move's message until the model moves; then it switches and steps as one built after."""
    import schedulefree

    out = {}
    for before in (True, False):
        with _out_of_reach_until_moved() as move:
            model = _model()
            build = lambda: ShardedOptimizer(model.parameters(), schedulefree.AdamWScheduleFree,  # noqa: E731
                                             stage=2, lr=1e-2, bucket_numel=500, collective_timeout=60)
            optimizer = build() if before else None
            if before:
                try:
                    optimizer.train()
                    out["unmoved train()"] = None
                except ValueError as error:
                    out["unmoved train()"] = str(error)
            model.to(torch.device("cpu", 0))
            move()
            optimizer = optimizer or build()
            optimizer.train()
            out[before] = _fit(rank, model, model, optimizer, 3)
    return out


def _compiled_after_the_move(rank):
    """Built before the model moves, then the model compiled (``torch.compile``, the eager backend) and trained 3
    steps: as the optimizer built after both. The first forward is the compiled module's, whose own parameters
    are its original module's."""
    runs = []
    for before in (True, False):
        torch._dynamo.reset()
        model = _model()
        build = lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,  # noqa: E731
                                         bucket_numel=500)
        optimizer = build() if before else None
        model.to(torch.device("cpu", 0))
        compiled = torch.compile(model, backend="eager")
        optimizer = optimizer or build()
        runs.append(_fit(rank, model, compiled, optimizer, 3))
    return runs


def _fp16_follows(rank):
    """A model converted to fp16 after construction: loss scaling turns on as for one built fp16."""
    model = _model()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    model.half()
    x = torch.ones(2, 20, dtype=torch.float16)
    optimizer.backward(model(x).float().sum())
    optimizer.step()
    return optimizer.loss_scale, next(model.parameters()).dtype


def _train(rank, stage, steps=3):
    """AdamW on the small model, 3 steps: torch's under DDP (``stage`` None), stage 1 under DDP, stage 2 without."""
    model = _model()
    if stage is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2, bucket_numel=500)
    _fit(rank, model, model if stage == 2 else DDP(model), optimizer, steps)
    return model, optimizer


def _consolidated(rank, shared):
    """consolidate_state_dict(to=0) after 3 steps: rank 0's state_dict() against DDP + AdamW's, and what rank 1's
    says; rank 0's file saved alone, then loaded by every rank (the model first) and consolidated again; a plain
    AdamW in one process continuing from it against the sharded run continued, after whose step state_dict() is
    the shard again."""
    out = {}
    reference = _train(rank, None)[1].state_dict()
    for stage in (1, 2):
        model, optimizer = _train(rank, stage)
        optimizer.consolidate_state_dict(0)
        try:
            full = optimizer.state_dict()
        except RuntimeError as error:  # (rank 1 under DDP, as ZeroRedundancyOptimizer's)
            full = str(error)
        path = os.path.join(shared, f"full-{stage}.pt")
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": full}, path)
        dist.barrier()
        saved = torch.load(path, weights_only=True)
        fresh_model, fresh = _train(rank, stage, steps=0)
        fresh_model.load_state_dict(saved["model"])
        fresh.load_state_dict(saved["optimizer"])
        fresh.consolidate_state_dict(0)
        again = fresh.state_dict()
        plain_model = _model()
        plain_model.load_state_dict(saved["model"])
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        plain.load_state_dict(saved["optimizer"])  # the plain inner optimizer, one process
        inputs = torch.randn(8, 20, generator=torch.Generator().manual_seed(7)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
        for net, opt in ((plain_model, plain), (fresh_model, fresh)):  # the same batch on both ranks: the average
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(inputs[0]), inputs[1]).backward()
            opt.step()
        out[stage] = {"full": full if rank == 0 or isinstance(full, str) else full.get("format"), "again": again if rank == 0 else None,
                      "after a step": fresh.state_dict().get("format"),
                      "continued": _bitwise(list(plain_model.parameters()), list(fresh_model.parameters()))}
    out["reference"] = reference if rank == 0 else None
    return out


def _resharded(rank, world_size, shared):
    """At 3 ranks: the full state saved at 2 (stage 2), loaded by every rank and consolidated again."""
    saved = torch.load(os.path.join(shared, "full-2.pt"), weights_only=True)
    model, optimizer = _train(rank, 2, steps=0)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    optimizer.consolidate_state_dict(0)
    return optimizer.state_dict() if rank == 0 else None, saved["optimizer"]


def _loaded_then_changed(rank, shared, change, load):
    """Optimizer state loaded, then the model changed before the first step (``change``), then 2 steps under DDP:
    returns the parameters, and those of the same run with the change made before building and loading."""
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = _train(rank, 1)  # (the state to load: 3 steps of stage 1 under DDP)
    directory, path = os.path.join(shared, "loaded"), os.path.join(shared, "loaded.pt")
    save_checkpoint(directory, optimizer, model)
    optimizer.consolidate_state_dict(0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    runs = []
    for before in (True, False):
        model = _model()
        if not before:
            CHANGES[change](model)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, bucket_numel=500)
        if load == "checkpoint":
            load_checkpoint(directory, optimizer, model)
        else:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        if before:
            CHANGES[change](model)
        runs.append(_fit(rank, model, DDP(model), optimizer, 2))
    dist.barrier()
    return runs


def _partly_converted_after_loading(rank, shared):
    """State loaded, then one layer converted to bf16 (its own bucket now): refused, naming the order."""
    model, optimizer = _train(rank, 2)
    fresh_model = _model()
    fresh = ShardedOptimizer(fresh_model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2, bucket_numel=500)
    fresh.load_state_dict(optimizer.state_dict())
    fresh_model[0].bfloat16()
    try:
        fresh_model(torch.ones(2, 20))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _loaded_then_edited_or_reformatted(rank):
    """Optimizer state loaded into a bf16 model (fp32 masters), then, before the first step: weights loaded, then a
    move (the step, at lr 0, must keep the loaded weights); a conversion to fp32 (the loaded masters would be
    dropped: refused); and for a conv model, a change to channels_last (the state would land on other elements:
    refused)."""
    out = {}
    for case in ("weights then move", "to fp32", "channels_last"):
        torch.manual_seed(0)
        model = (torch.nn.Conv2d(4, 8, 3) if case == "channels_last" else _model()).bfloat16()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.0, bucket_numel=500)
        optimizer.load_state_dict(optimizer.state_dict())
        try:
            if case == "weights then move":
                weights = {k: v * 0.5 for k, v in model.state_dict().items()}
                model.load_state_dict(weights)
                model.to(torch.device("cpu", 0))
                model(torch.ones(2, 20, dtype=torch.bfloat16)).float().sum().backward()
                optimizer.step()
                out[case] = all(torch.equal(value, model.state_dict()[k]) for k, value in weights.items())
            else:
                model.float() if case == "to fp32" else model.to(memory_format=torch.channels_last)
                model(torch.ones(2, 20) if case == "to fp32" else torch.ones(1, 4, 5, 5, dtype=torch.bfloat16))
                out[case] = "no error"
        except RuntimeError as error:
            out[case] = str(error)
    return out


def _replaced_twice(rank):
    """load_state_dict(assign=True) twice after building: the second replacement is trained, as built after."""
    runs = []
    for before in (True, False):
        model = _model()
        weights = [{k: v.clone() + i for k, v in _model().state_dict().items()} for i in range(2)]
        build = lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)  # noqa: E731
        optimizer = build() if before else None
        for state in weights:
            model.load_state_dict(state, assign=True)
        optimizer = optimizer or build()
        for step in range(2):
            optimizer.zero_grad()
            model(torch.full((2, 20), float(rank + step))).square().mean().backward()
            optimizer.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    return runs


def _edits_under_ddp(rank):
    """Under DDP: found_nonfinite(), then torch's clip_grad_value_, then step; and the optimizer's own
    clip_grad_norm_ (torch's on DDP's full gradients): against DDP + AdamW with torch's utilities."""
    out = {}
    for name in ("value after found_nonfinite", "own norm clipping"):
        runs = []
        for sharded in (False, True):
            model = _model()
            optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, bucket_numel=500)
                         if sharded else torch.optim.AdamW(model.parameters(), lr=1e-2))
            ddp, generator = DDP(model), torch.Generator().manual_seed(rank)
            norms = []
            for _ in range(3):
                optimizer.zero_grad()
                x, y = torch.randn(8, 20, generator=generator), torch.randint(0, 3, (8,), generator=generator)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                if name == "own norm clipping":
                    clip = optimizer.clip_grad_norm_ if sharded else (
                        lambda bound: torch.nn.utils.clip_grad_norm_(model.parameters(), bound))
                    norms.append(clip(0.05).item())
                else:
                    if sharded:
                        optimizer.found_nonfinite()
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                optimizer.step()
            runs.append([p.detach().clone() for p in model.parameters()] + [norms])
        out[name] = runs
    return out


def _nonfinite_under_ddp(rank):
    """Under DDP, a NaN in DDP's averaged gradient of the last parameter, whose piece rank 1 alone steps (written
    alike on every rank after backward): per ``nonfinite`` policy, what step() did on each rank and whether the
    parameters stayed; and a finite 3e38 there, whose square overflows the norm (stepped). Then ("per rank") a
    gradient divided by each rank's own count, rank 1's 0: Inf/NaN on rank 1 alone."""
    out = {}
    for policy, value in (("raise", float("nan")), ("skip", float("nan")), ("finite", 3e38)):
        model = _model()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, bucket_numel=500,
                                     nonfinite="skip" if policy == "skip" else "raise")
        ddp = DDP(model)
        _fit(rank, model, ddp, optimizer, 1)
        before = [p.detach().clone() for p in model.parameters()]
        ddp(torch.ones(2, 20)).sum().backward()
        with torch.no_grad():
            list(model.parameters())[-1].grad.view(-1)[-1] = value
        try:
            optimizer.step()
            outcome = f"skipped {optimizer.skipped_steps}"
        except FloatingPointError as error:
            outcome = str(error)
        out[policy] = (outcome, _bitwise(before, [p.detach() for p in model.parameters()]))
    model = _model()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, collective_timeout=20)
    ddp = DDP(model)
    ddp(torch.ones(2, 20)).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param.grad.div_(2.0 if rank == 0 else 0.0)  # (a mean over this rank's tokens, rank 1 having none)
    try:
        optimizer.step()
        out["per rank"] = "stepped"
    except (FloatingPointError, RuntimeError) as error:
        out["per rank"] = f"{type(error).__name__}: {error}"
    return out


def _agreement_under_ddp(rank):
    """found_nonfinite() (an all-reduce), then a finite edit of param.grad on rank 1 alone, then step(); and then
    param.grad set to None on every rank (torch steps none of that parameter): the parameters after the step, and
    whether they moved. NaN alike on every rank with 8-bit parameter gathers (raised) and with
    overlap_param_gather=False (skipped): the skipped steps, the gathers in flight after, the parameters unchanged."""
    out = {}
    for case in ("edited on one rank", "dropped on every rank"):
        model = _model()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, collective_timeout=20)
        ddp = DDP(model)
        ddp(torch.ones(2, 20)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.found_nonfinite()
        if case == "dropped on every rank":
            list(model.parameters())[0].grad = None
        elif rank == 1:
            list(model.parameters())[0].grad.mul_(0.5)
        start = time.monotonic()
        optimizer.step()
        optimizer.finish_param_gathers()
        out[case] = (time.monotonic() - start, [torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())])
    for case, options in (("8-bit gathers", dict(quantize_param_gather=True)),
                          ("no overlap", dict(overlap_param_gather=False, nonfinite="skip"))):
        model = _model()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2, **options)
        ddp = DDP(model)
        _fit(rank, model, ddp, optimizer, 2)
        optimizer.finish_param_gathers()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        ddp(torch.ones(2, 20)).sum().mul(float("nan")).backward()
        try:
            optimizer.step()
        except FloatingPointError:
            pass
        in_flight = optimizer.param_gathers_in_flight
        optimizer.finish_param_gathers()
        out[case] = (optimizer.skipped_steps, in_flight, _bitwise(before, [p.detach() for p in model.parameters()]))
    return out


def _partly_outside_ddp(rank):
    """Stage 1 under DDP over parameters DDP does not average: a layer outside the wrapper ("outside"), a parameter
    DDP ignores ("ignored"); what the first step raises on each rank. And ("frozen first") a layer frozen after the
    optimizer was built, before the wrap (DDP then holds the rest): parameters after 2 steps, against torch AdamW's."""
    out = {}
    for case in ("outside", "ignored"):
        torch.manual_seed(0)
        front = torch.nn.Linear(20, 20) if case == "outside" else torch.nn.Identity()
        model = _model()
        optimizer = ShardedOptimizer([*front.parameters(), *model.parameters()], torch.optim.AdamW, stage=1)
        if case == "ignored":
            DDP._set_params_and_buffers_to_ignore_for_model(model, ["2.bias"])
        ddp = DDP(model)
        try:
            _fit(rank, model, lambda x: ddp(front(x)), optimizer, 1)
            out[case] = "trained"
        except RuntimeError as error:
            out[case] = str(error)
    runs = []
    for sharded in (False, True):
        model = _model()
        optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1) if sharded
                     else torch.optim.AdamW(model.parameters()))
        model[0].requires_grad_(False)
        runs.append(_fit(rank, model, DDP(model), optimizer, 2))
    out["frozen first"] = runs
    return out


def _wrapped_after_a_first_backward(rank):
    """One backward of the bare model, zero_grad(), then the DDP wrap: trains as DDP + AdamW after the same."""
    runs = []
    for sharded in (False, True):
        model = _model()
        optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2) if sharded
                     else torch.optim.AdamW(model.parameters(), lr=1e-2))
        model(torch.ones(2, 20)).sum().backward()
        optimizer.zero_grad()
        runs.append(_fit(rank, model, DDP(model), optimizer, 2))
    return runs


def _consolidated_then_scheduled(rank):
    """consolidate_state_dict, then a scheduler step: state_dict() gives the groups' learning rate as it is now."""
    model, optimizer = _train(rank, 2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.1)
    optimizer.consolidate_state_dict(0)
    schedule.step()
    return optimizer.state_dict()["param_groups"][0]["lr"] if rank == 0 else None, optimizer.param_groups[0]["lr"]


def _consolidated_then_loaded(rank, shared):
    """consolidate_state_dict, then load_checkpoint of an earlier state: rank 0's state_dict() is no longer the full
    state consolidated before the load (its own shard, as after a step)."""
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = _train(rank, 2)
    save_checkpoint(os.path.join(shared, "before-consolidation"), optimizer, model)
    optimizer.consolidate_state_dict(0)
    load_checkpoint(os.path.join(shared, "before-consolidation"), optimizer, model)
    return optimizer.state_dict().get("format")


def _all(rank, world_size, shared):
    cases = {"tutorial": lambda: _tutorial_runs(rank, shared), "under ddp": lambda: _under_ddp(rank),
             "fp16": lambda: _fp16_follows(rank), "consolidated": lambda: _consolidated(rank, shared),
             "replaced twice": lambda: _replaced_twice(rank), "edits under ddp": lambda: _edits_under_ddp(rank),
             "nonfinite under ddp": lambda: _nonfinite_under_ddp(rank),
             "agreement under ddp": lambda: _agreement_under_ddp(rank),
             "partly outside ddp": lambda: _partly_outside_ddp(rank),
             "wrapped after a backward": lambda: _wrapped_after_a_first_backward(rank),
             "consolidated then scheduled": lambda: _consolidated_then_scheduled(rank),
             "consolidated then loaded": lambda: _consolidated_then_loaded(rank, shared),
             "partly converted after loading": lambda: _partly_converted_after_loading(rank, shared),
             "loaded then edited or reformatted": lambda: _loaded_then_edited_or_reformatted(rank),
             "moved into reach": lambda: _moved_into_reach(rank),
             "schedule-free moved into reach": lambda: _schedule_free_moved_into_reach(rank),
             "compiled after the move": lambda: _compiled_after_the_move(rank)}
    for change in ("cpu:0", "double"):
        for load in ("checkpoint", "full state"):
            cases[("loaded then", change, load)] = lambda change=change, load=load: _loaded_then_changed(
                rank, shared, change, load)
    for change in CHANGES:
        for stage, wrap in ((1, True), (1, False), (2, False)):
            cases[(change, stage, wrap)] = lambda change=change, stage=stage, wrap=wrap: (
                _changed_run(rank, change, stage, wrap, before=True), _changed_run(rank, change, stage, wrap, False))
    return run_cases(cases)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return str(tmp_path_factory.mktemp("swap"))


@pytest.fixture(scope="module")
def ranks(shared):
    return run_distributed(2, _all, shared)


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [1, 2])
def test_the_ddp_tutorial_with_the_swap_trains_bitwise_as_the_tutorial_and_resumes(ranks, stage):
    for out in case_results(ranks, "tutorial"):
        for run in ("whole", "resumed"):
            assert _bitwise(out[stage][run], out[0][run]), (stage, run)
        assert _bitwise(out[stage]["resumed"][:-1], out[stage]["whole"][:-1])  # the parameters at the end


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_stage_1_under_ddp_is_bitwise_ddp_with_the_same_torch_optimizer(ranks, variant):
    for out in case_results(ranks, "under ddp"):
        (reference, reference_losses), (zero, zero_losses) = out[variant]
        assert _bitwise(zero, reference) and zero_losses == reference_losses


def test_under_ddp_the_optimizer_reduces_nothing_and_gathers_the_parameters_once(ranks):
    """DDP's all-reduce (2Ψ, in C++: not counted here) is the only reduction: zeroimpl's calls per step are the
    5-element check all-reduce and the all-gather of the parameters, Ψ (padded) per step."""
    for out in case_results(ranks, "under ddp"):
        for per_step in out["collectives"]:
            assert not any("reduce_scatter" in name for name in per_step), per_step
            assert per_step["all_reduce"][:2] == (1, 5), per_step
            sent = sum(per_step.get(name, (0, 0))[1] for name in ("isend", "all_gather_into_tensor"))
            assert out["psi"] <= sent * (2 if "isend" in per_step else 1) <= out["psi"] + 64 * 8, per_step


def test_stage_2_under_ddp_is_refused_at_the_first_backward_on_every_rank(ranks):
    for reached_step, message in (out["stage 2"] for out in case_results(ranks, "under ddp")):
        assert not reached_step
        for expected in ("wrapped in DistributedDataParallel", "use stage=1", "drop the DDP wrap"):
            assert expected in message


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("stage, wrap", [(1, True), (1, False), (2, False)])
def test_a_model_changed_after_the_optimizer_was_built_trains_as_if_built_after(ranks, change, stage, wrap):
    for before, after in case_results(ranks, (change, stage, wrap)):
        assert _bitwise(before, after)


def test_an_optimizer_built_before_its_model_moves_into_the_collectives_reach_trains_as_one_built_after(ranks):
    for out in case_results(ranks, "moved into reach"):
        for setup in ((1, True, None), (1, False, None), (2, False, None), (2, False, "cpu")):
            before, after = out[setup]
            assert _bitwise(before, after), setup
        assert out["backward"] == out["step"] == "out of reach (moved: no)"


def test_a_schedule_free_mode_switch_before_the_move_raises_the_moves_message_then_trains_as_built_after(ranks):
    pytest.importorskip("schedulefree", reason="pip install schedulefree (the test extra installs it)")
    for out in case_results(ranks, "schedule-free moved into reach"):
        assert out["unmoved train()"] == "out of reach (moved: no)"
        assert _bitwise(out[True], out[False])


def test_a_model_moved_then_compiled_after_the_optimizer_was_built_trains_as_one_built_after(ranks):
    for before, after in case_results(ranks, "compiled after the move"):
        assert _bitwise(before, after)


def test_a_conversion_to_fp16_turns_loss_scaling_on(ranks):
    for scale, dtype in case_results(ranks, "fp16"):
        assert dtype == torch.float16 and scale is not None


@pytest.mark.parametrize("name", sorted(PEER_ARGUMENTS))
def test_arguments_of_zero_redundancy_optimizer_and_oss_are_refused_by_name(name):
    """They would otherwise reach the inner optimizer as hyperparameters (no process group needed: refused first)."""
    with pytest.raises(TypeError, match=f"no '{name}'"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.AdamW, stage=1, **{name: True})


def _same_state(a: dict, b: dict) -> bool:
    """Two torch-format optimizer states hold the same tensors, bitwise, and the same hyperparameters."""
    return a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys() and all(torch.equal(a["state"][i][k], b["state"][i][k])
                                                             for k in a["state"][i]) for i in a["state"]) and [
        {k: v for k, v in g.items()} for g in a["param_groups"]] == [{k: v for k, v in g.items()}
                                                                     for g in b["param_groups"]]


@pytest.mark.parametrize("stage", [1, 2])
def test_consolidate_state_dict_gives_rank_to_the_full_state_in_torchs_format(ranks, stage):
    """ZeroRedundancyOptimizer's contract: after consolidate_state_dict(to=0), state_dict() on rank 0 is the full
    state of DDP + AdamW, bitwise (the plain optimizer's numbering and hyperparameters). On rank 1: under DDP
    (stage 1) a refusal naming the consolidation, as ZeroRedundancyOptimizer's; without DDP its own shard. A step
    ends the consolidated state."""
    first, second = case_results(ranks, "consolidated")
    assert _same_state(first[stage]["full"], first["reference"])
    if stage == 1:
        assert "consolidate_state_dict(to=0)" in second[stage]["full"] and "save_state" in second[stage]["full"]
    else:
        assert second[stage]["full"] == "zeroimpl.sharded_optimizer/2"
    assert first[stage]["after a step"] == second[stage]["after a step"] == "zeroimpl.sharded_optimizer/2"


@pytest.mark.parametrize("stage", [1, 2])
def test_a_full_state_saved_by_rank_0_alone_loads_on_every_rank_and_continues(ranks, stage):
    """torch.save on rank 0 after consolidation is a complete checkpoint: every rank loads it (each takes its shard),
    consolidates the same state back bitwise, and steps as the plain AdamW that loaded it in one process."""
    first, second = case_results(ranks, "consolidated")
    assert _same_state(first[stage]["again"], first[stage]["full"])
    assert first[stage]["continued"] and second[stage]["continued"]


def test_a_full_state_saved_at_2_ranks_loads_at_3(ranks, shared):
    case_results(ranks, "consolidated")  # (it wrote the file)
    consolidated, saved = run_distributed(3, _resharded, shared)[0]
    assert _same_state(consolidated, saved)


@pytest.mark.parametrize("change", ["cpu:0", "double"])
@pytest.mark.parametrize("load", ["checkpoint", "full state"])
def test_state_loaded_before_the_model_moves_is_carried_over(ranks, change, load):
    """load_checkpoint or load_state_dict of a full state, then model.to(cpu:0) or .double() before the first step:
    the loaded state (moments, step counts, masters) is kept, bitwise the run that changed the model first."""
    for before, after in case_results(ranks, ("loaded then", change, load)):
        assert _bitwise(before, after)


def test_a_conversion_that_changes_the_layout_after_a_load_is_refused(ranks):
    for message in case_results(ranks, "partly converted after loading"):
        assert "convert the model first, then load" in message, message


def test_after_a_load_weights_loaded_before_the_move_stay_and_conversions_that_drop_state_are_refused(ranks):
    for out in case_results(ranks, "loaded then edited or reformatted"):
        assert out["weights then move"] is True
        for case in ("to fp32", "channels_last"):
            assert "convert the model first, then load" in out[case], out[case]


def test_a_parameter_replaced_twice_before_the_first_step_is_trained(ranks):
    for before, after in case_results(ranks, "replaced twice"):
        assert _bitwise(before, after)


@pytest.mark.parametrize("name", ["value after found_nonfinite", "own norm clipping"])
def test_under_ddp_edits_of_param_grad_before_the_step_count(ranks, name):
    """An edit of param.grad after found_nonfinite() is taken in; the optimizer's own clip_grad_norm_ is torch's on
    DDP's full gradients: bitwise DDP + AdamW with torch's utilities, norms included."""
    for torch_run, zero_run in (out[name] for out in case_results(ranks, "edits under ddp")):
        assert _bitwise(zero_run, torch_run)


def test_under_ddp_nan_in_a_piece_one_rank_steps_or_in_one_ranks_gradient_is_found_on_every_rank(ranks):
    """A NaN in the piece rank 1 alone steps: raised (or skipped) on both ranks, the parameters untouched; a finite
    gradient whose norm overflows is stepped. A gradient edited per rank (Inf/NaN on rank 1 alone, as a mean over
    a rank without tokens gives): FloatingPointError on both ranks, never one rank stepping into the all-gather
    while the other raised (a local check would hang there until the timeout)."""
    for out in case_results(ranks, "nonfinite under ddp"):
        raised, raise_untouched = out["raise"]
        assert "NaN or Inf" in raised and raise_untouched
        assert out["skip"] == ("skipped 1", True)
        assert out["finite"] == ("skipped 0", False)
        assert out["per rank"].startswith("FloatingPointError: the averaged gradients hold NaN or Inf"), out["per rank"]


def test_under_ddp_every_step_agrees_afresh(ranks):
    """The step's check all-reduce runs on every rank even after found_nonfinite(): an edit of param.grad on one rank
    since (which makes that rank alone take DDP's gradients afresh) steps at once, never waiting out the timeout; a
    param.grad set to None since is not stepped, as with torch. A NaN alike on every rank leaves the parameters
    bitwise, 8-bit gathers included, and no gather in flight."""
    for out in case_results(ranks, "agreement under ddp"):
        seconds, unchanged = out["edited on one rank"]
        assert seconds < 10 and not any(unchanged), out
        seconds, unchanged = out["dropped on every rank"]
        assert unchanged[0] and not any(unchanged[1:]), out
        assert out["8-bit gathers"] == (1, 0, True), out
        assert out["no overlap"] == (1, 0, True), out


@pytest.mark.parametrize("case", ["outside", "ignored"])
def test_under_ddp_parameters_ddp_does_not_average_are_refused_on_every_rank(ranks, case):
    """Stage 1 under DDP steps from DDP's averaged param.grad: a parameter outside the wrapper, or one DDP ignores,
    would be stepped from one rank's own gradient (the ranks' models then differ from DDP + AdamW's): refused at
    the first backward, naming the fixes."""
    count = {"outside": "2 trainable parameter", "ignored": "1 trainable parameter"}[case]
    for out in case_results(ranks, "partly outside ddp"):
        for expected in ("not averaged by DistributedDataParallel", count, "wrap every parameter"):
            assert expected in out[case], out[case]


def test_under_ddp_a_layer_frozen_before_the_wrap_trains_as_ddp(ranks):
    for torch_run, zero_run in (out["frozen first"] for out in case_results(ranks, "partly outside ddp")):
        assert _bitwise(zero_run, torch_run)


def test_a_model_wrapped_in_ddp_after_a_first_backward_trains_as_ddp(ranks):
    for torch_run, zero_run in case_results(ranks, "wrapped after a backward"):
        assert _bitwise(zero_run, torch_run)


def test_a_load_ends_the_consolidated_state(ranks):
    assert case_results(ranks, "consolidated then loaded") == ["zeroimpl.sharded_optimizer/2"] * 2


def test_the_consolidated_state_gives_the_learning_rate_as_it_is_now(ranks):
    saved, current = case_results(ranks, "consolidated then scheduled")[0]
    assert saved == current == pytest.approx(1e-3)


def _ray_train_function(config):
    """Ray Train's training function as its guides write it: prepare_model (DDP), then the optimizer."""
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(_model())
    optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2) if config["sharded"]
                 else torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank = ray.train.get_context().get_world_rank()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(4):
        optimizer.zero_grad()
        x, y = torch.randn(8, 20, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    torch.save([p.detach() for p in model.parameters()], os.path.join(config["folder"], f"{config['sharded']}-{rank}.pt"))


def test_ray_trains_default_prepare_model_with_a_stage_1_sharded_optimizer_bitwise(tmp_path):
    """Ray Train's default prepare_model wraps the model in DDP: ShardedOptimizer(stage=1) in AdamW's place trains
    bitwise as it, on 2 CPU workers (skipped where ray[train] is not installed)."""
    ray = pytest.importorskip("ray", reason="pip install 'zeroimpl[ray]' (in the test extra)")
    import ray.train.torch
    from ray.train import RunConfig, ScalingConfig

    here = os.path.dirname(os.path.abspath(__file__))  # (the workers import this module)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": here, "OMP_NUM_THREADS": "1"}})
    try:
        for sharded in (False, True):
            trainer = ray.train.torch.TorchTrainer(
                _ray_train_function, train_loop_config={"sharded": sharded, "folder": str(tmp_path)},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=str(tmp_path / "results"), name=f"sharded-{sharded}"))
            assert trainer.fit().error is None
    finally:
        ray.shutdown()
    for rank in range(2):
        reference, sharded = (torch.load(tmp_path / f"{kind}-{rank}.pt") for kind in (False, True))
        assert _bitwise(sharded, reference)
