"""PyTorch Lightning's Trainer and Fabric with zeroimpl's strategies (zeroimpl/integrations/lightning.py) against
Lightning's own DDPStrategy with the same torch optimizer, model and data: real ranks, real gloo collectives.

Lightning runs inside the ranks of ``run_distributed`` (RANK, LOCAL_RANK, WORLD_SIZE set, the gloo group already
initialised): Lightning picks its LightningEnvironment (LOCAL_RANK is set, so it launches nothing) and reuses the
process group. Every case of a world size runs in one launch (``run_cases``).

The model: an MLP with a BatchNorm layer (452 parameters), AdamW in two param groups (decay / no decay), a StepLR
schedule stepped every optimizer step, 8 batches of 8 samples split over the ranks, 2 epochs, a validation pass
per epoch; rank 1 initialises other weights than rank 0, so that the broadcast at setup is checked too.

Measured (each test prints its differences with -s): bitwise equal to DDPStrategy (weights and buffers on every
rank, learning rates, losses) in fp32 without clipping (stage 1, stage 2, stage 2 with offload, a prebuilt
ShardedOptimizer; Trainer and Fabric), stage 1 with accumulation, clipping by value, and a resume from a checkpoint
against the uninterrupted run. Bounds, where the summation order may differ:

* ACCUMULATION_ATOL (measured 1.2e-7): stage 2 reduces each micro-batch, DDP sums them before its all-reduce.
* CLIP_ATOL (measured 1.2e-7; manual optimization, which also accumulates in stage 2: 4.8e-7; fp16 through the
  GradScaler: 3.0e-8, Trainer and Fabric): clipping by norm
  through ShardedOptimizer.clip_grad_norm_, the global norm summed from the shards in another order.
* MIXED_ATOL (measured 0.0, bitwise): bf16-mixed, and fp16 through Lightning's MixedPrecision plugin and its
  GradScaler acting on the sharded gradients, with a first scale (2**20) so large that three steps overflow (skipped
  on every rank; 2**17 at the end, as DDP's). Autocast keeps the parameters, and so the gradients, in fp32 and
  they are reduced as in fp32 runs; the bound is the fp32 bound.
* RESUME_ON_ONE_ATOL (measured 0.0, bitwise): saved at 2 devices, resumed at 1 with accumulate_grad_batches=2
  (the same global batch): halving the two micro-batches' gradients is exact, so the sums agree.
"""

import os
import shutil
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from distributed import case_result, case_results, run_cases, run_distributed
from zeroimpl.integrations.lightning import REGISTERED

ACCUMULATION_ATOL = 1e-6
CLIP_ATOL = 1e-6
MIXED_ATOL = 1e-6
RESUME_ON_ONE_ATOL = 1e-6
LOSS_ATOL = 1e-5  # losses after steps whose weights agree within a tolerance
EPOCHS, BATCHES, BATCH_SIZE = 2, 8, 8
FP16_INITIAL_SCALE = 2.0 ** 20


def build_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def batches(count: int = BATCHES) -> list:
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH_SIZE, 8, generator=generator), torch.randint(0, 4, (BATCH_SIZE,), generator=generator))
            for _ in range(count)]


def loader(rank: int, world_size: int):
    """Each item a whole batch, rank r of W taking batches r, r + W, ... in every epoch: step k sees the same
    batches at 2 devices as at 1 device accumulating 2. (The sampler Lightning puts in shuffled this loader, and a
    Trainer resumed from the end of the first epoch saw the first epoch's order again, under DDPStrategy as here.)"""
    sampler = torch.utils.data.DistributedSampler(batches(), world_size, rank, shuffle=False)
    return torch.utils.data.DataLoader(batches(), batch_size=None, sampler=sampler)


def adamw(net: torch.nn.Module):
    decay = [p for p in net.parameters() if p.dim() > 1]
    other = [p for p in net.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                  lr=2e-2)
    return optimizer, step_lr(optimizer)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)


def snapshot(net: torch.nn.Module) -> dict:
    return {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}


# -- Trainer ----------------------------------------------------------------------------------------
def _lightning_module(prebuilt_options=None, manual=False):
    import lightning

    class Net(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_net()
            self.losses, self.learning_rates = [], []
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            if manual:
                return self.manual_step(batch, batch_idx)
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def manual_step(self, batch, batch_idx):
            """Manual optimization as Lightning's docs write it: two micro-batches a step, the first under
            toggle_model(sync_grad=False), clipping by norm, the scheduler stepped by hand."""
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            final = batch_idx % 2 == 1
            with optimizer.toggle_model(sync_grad=final):
                x, y = batch
                loss = F.cross_entropy(self.net(x), y)
                self.manual_backward(loss / 2)
            self.losses.append(loss.item())
            if final:
                self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_before_optimizer_step(self, optimizer):
            self.learning_rates.append(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self):
            optimizer, scheduler = adamw(self.net)
            if prebuilt_options is not None:  # what a user who builds the ShardedOptimizer hands over
                from zeroimpl import ShardedOptimizer
                optimizer = ShardedOptimizer(optimizer.param_groups, torch.optim.AdamW, lr=2e-2, **prebuilt_options)
                scheduler = step_lr(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self):
            return loader(self.trainer.global_rank, self.trainer.world_size)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(batches(4), batch_size=None)

    return Net()


def fit(rank, strategy, directory=None, ckpt_path=None, devices=2, prebuilt_options=None, save_top_k=None,
        manual=False, save_last=None, **trainer_kwargs):
    """One Trainer.fit, with a ModelCheckpoint after every epoch that keeps ``save_top_k`` (``None``: none) and
    ``save_last``; returns this rank's weights and buffers, losses, learning rates and what was trained."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(rank)  # other initial weights per rank: the strategy broadcasts rank 0's, as DDP does
    module = _lightning_module(prebuilt_options, manual)
    save = save_top_k is not None
    callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=save_top_k, every_n_epochs=1,
                                 save_last=save_last)] if save else []
    world = torch.distributed.group.WORLD
    trainer = lightning.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS,
                                enable_progress_bar=False, logger=False, enable_model_summary=False,
                                num_sanity_val_steps=0, enable_checkpointing=save, callbacks=callbacks,
                                default_root_dir=directory, use_distributed_sampler=False, **trainer_kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {**trained(module, trainer.optimizers[0], trainer.strategy, scaler), "step": trainer.global_step,
            "world_size": trainer.world_size, "model": type(trainer.strategy.model).__name__,
            "losses": module.losses, "learning_rates": module.learning_rates,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "same_process_group": torch.distributed.group.WORLD is world}


def trained(net, optimizer, strategy, scaler) -> dict:
    """This rank's weights and buffers, and what trained them."""
    return {"state": snapshot(net), "optimizer": type(optimizer).__name__, "strategy": type(strategy).__name__,
            "options": getattr(strategy, "zero_options", None), "scale": None if scaler is None else scaler.get_scale(),
            "groups": [(getattr(g.get("optimizer"), "__name__", None), g["weight_decay"], g["betas"])
                       for g in optimizer.param_groups]}


def _fp16_plugin():
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FP16_INITIAL_SCALE))


def _resumed_without_shards(rank, saved: str, copy: str, resume) -> str:
    """The checkpoint directory ``saved`` copied to ``copy`` without its shard folders, then ``resume(copy)``: the
    FileNotFoundError's message (it must raise on every rank, naming the folder)."""
    if rank == 0:
        shutil.copytree(saved, copy, ignore=lambda folder, names: [
            name for name in names if os.path.isdir(os.path.join(folder, name))])
    torch.distributed.barrier()
    try:
        resume(copy)
    except FileNotFoundError as error:
        return str(error)
    return "no error"


def _missing_shards(rank, shared):
    """A checkpoint whose shard folder is gone: fit(ckpt_path=...) raises on every rank, naming it."""
    return _resumed_without_shards(rank, os.path.join(shared, "zero2", "epoch=0-step=4.ckpt"),
                                   os.path.join(shared, "missing", "epoch=0.ckpt"),
                                   lambda copy: fit(rank, "zero2", os.path.join(shared, "missing_run"), ckpt_path=copy))


def _checkpoint_contents(path):
    checkpoint = torch.load(os.path.join(path, "lightning.ckpt"), weights_only=True)
    return {"listing": sorted(os.listdir(path)), "shards": sorted(os.listdir(os.path.join(path, "optimizer-0"))),
            "record": checkpoint["zeroimpl"],
            "optimizer_states": checkpoint["optimizer_states"], "has_scheduler": bool(checkpoint["lr_schedulers"])}


def _two_optimizers(directory, ckpt_path=None) -> dict:
    """Manual optimization of two same-shape nets, each with its own AdamW (another learning rate), ``zero2``,
    checkpointed after every epoch (or resumed from ``ckpt_path``): this rank's weights and the losses."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    class TwoNets(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.nets = torch.nn.ModuleList([build_net(), build_net()])
            self.automatic_optimization = False
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            for net, optimizer in zip(self.nets, self.optimizers()):
                loss = F.cross_entropy(net(x), y)
                self.manual_backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                self.losses.append(loss.item())

        def configure_optimizers(self):
            return [torch.optim.AdamW(net.parameters(), lr=lr) for net, lr in zip(self.nets, (2e-2, 5e-3))]

        def train_dataloader(self):
            return loader(self.trainer.global_rank, self.trainer.world_size)

    torch.manual_seed(0)
    module = TwoNets()
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="zero2", max_epochs=EPOCHS,
                                enable_progress_bar=False, logger=False, enable_model_summary=False,
                                callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1)],
                                default_root_dir=directory, use_distributed_sampler=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"state": snapshot(module), "losses": module.losses}


def _refused(run):
    try:
        run()
    except ValueError as error:
        return str(error)
    return "no error"


def _trainer_cases(rank, shared):
    import zeroimpl.integrations.lightning  # noqa: F401 - registers zero1, zero2, zero2_offload
    from lightning.pytorch.strategies import DDPStrategy

    run = partial(fit, rank)
    folder = partial(os.path.join, shared)
    return {
        "ddp": lambda: run(DDPStrategy()),
        "zero1": lambda: run("zero1", folder("zero1"), save_top_k=1, save_last="link"),
        "zero2": lambda: run("zero2", folder("zero2"), save_top_k=-1),
        "zero2_offload": lambda: run("zero2_offload"),
        "prebuilt": lambda: run("zero1", prebuilt_options={"stage": 2}),
        "ddp_accumulate": lambda: run(DDPStrategy(), accumulate_grad_batches=2),
        "zero1_accumulate": lambda: run("zero1", accumulate_grad_batches=2),
        "zero2_offload_accumulate": lambda: run("zero2_offload", accumulate_grad_batches=2),
        "ddp_clip_norm": lambda: run(DDPStrategy(), gradient_clip_val=0.05),
        "zero2_clip_norm": lambda: run("zero2", gradient_clip_val=0.05),
        "ddp_clip_value": lambda: run(DDPStrategy(), gradient_clip_val=0.01, gradient_clip_algorithm="value"),
        "zero2_clip_value": lambda: run("zero2", gradient_clip_val=0.01, gradient_clip_algorithm="value"),
        "ddp_manual": lambda: run(DDPStrategy(), manual=True),
        "zero2_manual": lambda: run("zero2", manual=True),
        "ddp_bf16": lambda: run(DDPStrategy(), precision="bf16-mixed"),
        "zero2_bf16": lambda: run("zero2", precision="bf16-mixed"),
        "ddp_fp16": lambda: run(DDPStrategy(), plugins=[_fp16_plugin()]),
        "zero2_fp16": lambda: run("zero2", plugins=[_fp16_plugin()]),
        "ddp_fp16_clip_norm": lambda: run(DDPStrategy(), plugins=[_fp16_plugin()], gradient_clip_val=0.05),
        "zero2_fp16_clip_norm": lambda: run("zero2", plugins=[_fp16_plugin()], gradient_clip_val=0.05),
        "resumed": lambda: run("zero2", folder("resumed"), ckpt_path=folder("zero2", "epoch=0-step=4.ckpt")),
        # strategy="ddp" with a stage-1 ShardedOptimizer from configure_optimizers: the one-line swap
        "ddp_sharded": lambda: run("ddp", folder("ddp_sharded"), save_top_k=-1, prebuilt_options={"stage": 1}),
        "ddp_sharded_resumed": lambda: run("ddp", folder("ddp_sharded_resumed"), prebuilt_options={"stage": 1},
                                           ckpt_path=folder("ddp_sharded", "epoch=0-step=4.ckpt")),
        "ddp_sharded_checkpoint": lambda: torch.load(folder("ddp_sharded", "epoch=0-step=4.ckpt"),
                                                     weights_only=True)["optimizer_states"],
        "two_optimizers": lambda: _two_optimizers(folder("two_optimizers")),
        "two_optimizers_resumed": lambda: _two_optimizers(folder("two_optimizers_resumed"),
                                                          folder("two_optimizers", "epoch=0-step=8.ckpt")),
        "checkpoint": lambda: _checkpoint_contents(folder("zero2", "epoch=0-step=4.ckpt")),
        "kept_one": lambda: [(name, os.path.isdir(folder("zero1", name)), os.path.islink(folder("zero1", name)))
                             for name in sorted(os.listdir(folder("zero1")))],
        "missing_shards": lambda: _missing_shards(rank, shared),
        "fp16_parameters": lambda: _refused(partial(run, "zero2", precision="16-true")),
    }


# -- Fabric -----------------------------------------------------------------------------------------
def fabric_run(rank, strategy, accumulate=1, clip=None, separate_setup=False, save=None, resume=None,
               scheduler_kept=False, sharded=False, **fabric_kwargs):
    """A plain Fabric loop; ``save``: the path to fabric.save after the first epoch (and stop), ``resume``: the
    path to fabric.load before training, which restores the epoch to start from (a plain value in the state); ``scheduler_kept``: a SequentialLR (warm-up,
    then StepLR) built over the torch optimizer and not handed to Fabric, which the loop steps; ``sharded``: a
    ShardedOptimizer(stage=1) over the same groups in the torch optimizer's place (the one-line swap)."""
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=2, strategy=strategy, **fabric_kwargs)
    fabric.launch()
    torch.manual_seed(rank)
    net = build_net()
    if separate_setup:  # setup_module, then the optimizer over the set-up module, then setup_optimizers
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(adamw(net)[0])
        scheduler = step_lr(optimizer)
    elif scheduler_kept:  # its children hold the torch optimizer: the strategy's replacement must follow them
        optimizer, _ = adamw(net)
        warm_up = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=2)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm_up, step_lr(optimizer)], milestones=[2])
        model, optimizer = fabric.setup(net, optimizer)
    else:
        optimizer, scheduler = adamw(net)
        if sharded:
            from zeroimpl import ShardedOptimizer
            optimizer = ShardedOptimizer(optimizer.param_groups, torch.optim.AdamW, stage=1, lr=2e-2)
            scheduler = step_lr(optimizer)
        model, optimizer, scheduler = fabric.setup(net, optimizer, scheduler=scheduler)
    data = fabric.setup_dataloaders(loader(fabric.global_rank, fabric.world_size), use_distributed_sampler=False)
    losses, learning_rates = [], []
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}  # a plain value too
    if resume is not None:
        fabric.load(resume, state)  # sets state["epoch"] to the saved 1
    for epoch in range(state["epoch"], EPOCHS):
        for index, (x, y) in enumerate(data):
            final = (index + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not final):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
            if final:
                if clip is not None:
                    fabric.clip_gradients(model, optimizer, max_norm=clip, error_if_nonfinite=False)
                learning_rates.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        if save is not None:
            state["epoch"] = epoch + 1
            fabric.save(save, state)
            break
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    return {**trained(net, optimizer.optimizer, fabric.strategy, scaler), "losses": losses,
            "learning_rates": learning_rates, "model": type(model._forward_module).__name__}  # (Fabric's wrapped one)


def _fabric_fp16_plugin():
    from lightning.fabric.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FP16_INITIAL_SCALE))


def _fabric_missing(rank, shared):
    return _resumed_without_shards(rank, os.path.join(shared, "fabric.ckpt"),
                                   os.path.join(shared, "missing", "fabric.ckpt"),
                                   lambda copy: fabric_run(rank, "zero2", resume=copy))


def _fabric_cases(rank, shared):
    from lightning.fabric.strategies import DDPStrategy

    run = partial(fabric_run, rank)
    checkpoint = os.path.join(shared, "fabric.ckpt")
    return {
        ("fabric", "ddp"): lambda: run(DDPStrategy()),
        ("fabric", "zero1"): lambda: run("zero1"),
        ("fabric", "zero2"): lambda: run("zero2", separate_setup=True),
        ("fabric", "zero2_offload"): lambda: run("zero2_offload"),
        ("fabric", "ddp_accumulate"): lambda: run(DDPStrategy(), accumulate=2),
        ("fabric", "zero1_accumulate"): lambda: run("zero1", accumulate=2),
        ("fabric", "zero2_accumulate"): lambda: run("zero2", accumulate=2),
        ("fabric", "ddp_clip_norm"): lambda: run(DDPStrategy(), clip=0.05),
        ("fabric", "zero2_clip_norm"): lambda: run("zero2", clip=0.05),
        ("fabric", "ddp_bf16"): lambda: run(DDPStrategy(), precision="bf16-mixed"),
        ("fabric", "zero2_bf16"): lambda: run("zero2", precision="bf16-mixed"),
        ("fabric", "ddp_fp16"): lambda: run(DDPStrategy(), plugins=[_fabric_fp16_plugin()]),
        ("fabric", "zero2_fp16"): lambda: run("zero2", plugins=[_fabric_fp16_plugin()]),
        ("fabric", "ddp_fp16_clip_norm"): lambda: run(DDPStrategy(), clip=0.05, plugins=[_fabric_fp16_plugin()]),
        ("fabric", "zero2_fp16_clip_norm"): lambda: run("zero2", clip=0.05, plugins=[_fabric_fp16_plugin()]),
        ("fabric", "ddp_scheduler_kept"): lambda: run(DDPStrategy(), scheduler_kept=True),
        ("fabric", "zero2_scheduler_kept"): lambda: run("zero2", scheduler_kept=True),
        ("fabric", "saved"): lambda: run("zero2", save=checkpoint),
        ("fabric", "resumed"): lambda: run("zero2", resume=checkpoint),
        ("fabric", "missing_shards"): lambda: _fabric_missing(rank, shared),
        ("fabric", "ddp_sharded"): lambda: run(DDPStrategy(), sharded=True),
        ("fabric", "ddp_sharded_saved"): lambda: run(DDPStrategy(), sharded=True, save=checkpoint + ".ddp"),
        ("fabric", "ddp_sharded_resumed"): lambda: run(DDPStrategy(), sharded=True, resume=checkpoint + ".ddp"),
    }


def _two_ranks(rank, world_size, shared):
    return run_cases({**_trainer_cases(rank, shared), **_fabric_cases(rank, shared)})


def _resume_on_one(rank, world_size, shared):
    import zeroimpl.integrations.lightning  # noqa: F401

    return run_cases({"resumed_on_one": lambda: fit(rank, "zero2", os.path.join(shared, "on_one"), devices=1,
                                                     ckpt_path=os.path.join(shared, "zero2", "epoch=0-step=4.ckpt"),
                                                     accumulate_grad_batches=2)})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case at 2 ranks in one launch, then the resume at 1 rank (its checkpoint comes from the first)."""
    shared = str(tmp_path_factory.mktemp("lightning"))
    return run_distributed(2, _two_ranks, shared), run_distributed(1, _resume_on_one, shared)[0]


def max_difference(a: dict, b: dict, names=None) -> float:
    return max((a["state"][n].double() - b["state"][n].double()).abs().max().item() for n in (names or b["state"]))


def compare(ranks, name: str, reference: str, atol: float = 0.0) -> list:
    """``name`` against ``reference`` on every rank: weights and buffers within ``atol`` (0: bitwise), the same
    learning rates (a schedule that moved), and losses as close; returns the per-rank differences."""
    two, _ = ranks
    differences = []
    for run, expected in zip(case_results(two, name), case_results(two, reference)):
        differences.append(max_difference(run, expected))
        assert run["learning_rates"] == expected["learning_rates"] and len(set(run["learning_rates"])) > 2
        assert len(run["losses"]) == len(expected["losses"])
        assert max(abs(a - b) for a, b in zip(run["losses"], expected["losses"])) <= (LOSS_ATOL if atol else 0.0)
    print(f"{name} against {reference}: max |difference| per rank {differences}")
    assert max(differences) <= atol, differences
    return differences


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload", "prebuilt"])
def test_trainer_matches_ddp_bitwise(ranks, name):
    """Trainer(strategy="zero1" / "zero2" / "zero2_offload"), and a ShardedOptimizer built in configure_optimizers
    (taken as is), against DDPStrategy + torch's AdamW: weights and buffers (BatchNorm) bitwise on every rank."""
    compare(ranks, name, "ddp")
    for run in case_results(ranks[0], name):
        assert run["model"] == "Net" and run["optimizer"] == "ShardedOptimizer"  # never wrapped in DDP
        assert run["groups"] == [("AdamW", 0.1, (0.9, 0.999)), ("AdamW", 0.0, (0.9, 0.999))]
        assert run["environment"] == "LightningEnvironment" and run["same_process_group"]
    if name != "prebuilt":
        assert case_results(ranks[0], name)[0]["strategy"] == "ZeroStrategy"
        assert case_results(ranks[0], name)[0]["options"] == {"offload": None, **REGISTERED[name]}


def test_trainer_accumulation(ranks):
    """accumulate_grad_batches=2: stage 1 sums the micro-batches before one reduction, as DDP's no_sync does
    (bitwise); stage 2 with offload reduces each (measured 3.0e-8)."""
    compare(ranks, "zero1_accumulate", "ddp_accumulate")
    compare(ranks, "zero2_offload_accumulate", "ddp_accumulate", ACCUMULATION_ATOL)


def test_trainer_clipping(ranks):
    """gradient_clip_val by norm goes through ShardedOptimizer.clip_grad_norm_ (measured 1.5e-8); by value,
    torch's clip_grad_value_ on the sharded gradients (bitwise). Clipping really changed the run."""
    compare(ranks, "zero2_clip_norm", "ddp_clip_norm", CLIP_ATOL)
    compare(ranks, "zero2_clip_value", "ddp_clip_value")
    two, _ = ranks
    assert max_difference(case_result(two[0], "ddp_clip_norm"), case_result(two[0], "ddp")) > 1e-3
    assert max_difference(case_result(two[0], "ddp_clip_value"), case_result(two[0], "ddp")) > 1e-3


def test_trainer_manual_optimization(ranks):
    """manual_backward, toggle_model(sync_grad=False) for accumulation, self.clip_gradients by norm, the
    scheduler stepped by hand: within the tolerances of stage 2's accumulation and of clipping (measured 4.8e-7),
    buffers included (DDPStrategy broadcasts them only before the first manual forward, and so does this)."""
    compare(ranks, "zero2_manual", "ddp_manual", max(ACCUMULATION_ATOL, CLIP_ATOL))


def test_trainer_mixed_precision(ranks):
    """bf16-mixed, and fp16 through Lightning's MixedPrecision plugin with its GradScaler (on CPU Lightning turns
    precision="16-mixed" into bf16-mixed, so the plugin is passed): bitwise equal to DDPStrategy, the same steps
    skipped for overflow (the same final scale, below the first)."""
    compare(ranks, "zero2_bf16", "ddp_bf16", MIXED_ATOL)
    compare(ranks, "zero2_fp16", "ddp_fp16", MIXED_ATOL)
    two, _ = ranks
    zero, ddp = case_result(two[0], "zero2_fp16"), case_result(two[0], "ddp_fp16")
    print(f"fp16 loss scale: first {FP16_INITIAL_SCALE}, last {zero['scale']} (DDP: {ddp['scale']})")
    assert zero["scale"] == ddp["scale"] < FP16_INITIAL_SCALE
    assert max_difference(case_result(two[0], "ddp_bf16"), case_result(two[0], "ddp")) > 1e-3  # bf16 really ran


def test_trainer_clips_the_unscaled_fp16_gradients(ranks):
    """fp16 with gradient_clip_val: the norm is clipped after the GradScaler unscaled the sharded gradients, as
    under DDPStrategy (within CLIP_ATOL), with the same steps skipped."""
    compare(ranks, "zero2_fp16_clip_norm", "ddp_fp16_clip_norm", CLIP_ATOL)
    zero, ddp = (case_result(ranks[0][0], name) for name in ("zero2_fp16_clip_norm", "ddp_fp16_clip_norm"))
    assert zero["scale"] == ddp["scale"] < FP16_INITIAL_SCALE


def test_trainer_resume_is_bitwise(ranks):
    """fit(ckpt_path=) from ModelCheckpoint's checkpoint after epoch 0 continues as the uninterrupted run: weights
    on every rank bitwise (rank 0's buffers too), the same learning rates and losses."""
    two, _ = ranks
    for rank, (resumed, whole) in enumerate(zip(case_results(two, "resumed"), case_results(two, "zero2"))):
        assert resumed["step"] == whole["step"] == EPOCHS * BATCHES // 2
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        assert resumed["learning_rates"] == whole["learning_rates"][len(whole["learning_rates"]) // 2:]
        names = [n for n in whole["state"] if rank == 0 or n.split(".")[-1] in ("weight", "bias")]
        assert max_difference(resumed, whole, names) == 0.0


def test_trainer_resumes_two_optimizers_each_from_its_own_shards(ranks):
    """Two same-shape nets with their own optimizers (another lr each), manual optimization: resumed after epoch 0,
    each optimizer from its own shard folder, the second epoch is bitwise the uninterrupted run's (rank 1's
    buffers aside: the checkpoint holds rank 0's, as in test_trainer_resume_is_bitwise)."""
    two, _ = ranks
    pairs = zip(case_results(two, "two_optimizers_resumed"), case_results(two, "two_optimizers"))
    for rank, (resumed, whole) in enumerate(pairs):
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        names = [n for n in whole["state"] if rank == 0 or n.split(".")[-1] in ("weight", "bias")]
        assert max_difference(resumed, whole, names) == 0.0


def test_strategy_ddp_with_a_stage_1_sharded_optimizer_trains_and_resumes_bitwise_as_ddp(ranks):
    """The one-line swap in Lightning: strategy="ddp" and configure_optimizers returning ShardedOptimizer(stage=1).
    DDP wraps the model and averages the gradients; Lightning calls consolidate_state_dict() before it checkpoints,
    so rank 0's file holds the full state in torch's format (every parameter's exp_avg, of its full shape), and
    fit(ckpt_path=) loads it on every rank, each taking its shard: bitwise DDPStrategy + AdamW, uninterrupted or
    resumed."""
    compare(ranks, "ddp_sharded", "ddp")
    two, _ = ranks
    for run in case_results(two, "ddp_sharded"):
        assert run["strategy"] == "DDPStrategy" and run["optimizer"] == "ShardedOptimizer"
    for rank, (resumed, whole) in enumerate(zip(case_results(two, "ddp_sharded_resumed"),
                                                case_results(two, "ddp_sharded"))):
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        names = [n for n in whole["state"] if rank == 0 or n.split(".")[-1] in ("weight", "bias")]
        assert max_difference(resumed, whole, names) == 0.0
    (saved,) = case_results(two, "ddp_sharded_checkpoint")[0]
    shapes = sorted(tuple(state["exp_avg"].shape) for state in saved["state"].values())
    assert shapes == sorted(tuple(p.shape) for p in build_net().parameters())


def test_trainer_checkpoint_is_a_directory_of_the_lightning_file_and_every_rank_shard(ranks):
    """The checkpoint path is a directory, as Lightning's DeepSpeed and FSDP strategies make it: the Lightning file
    (a placeholder for the optimizer) and the optimizer's folder of both ranks' shards."""
    for contents in case_results(ranks[0], "checkpoint"):
        assert contents["listing"] == ["lightning.ckpt", "optimizer-0"]
        assert contents["shards"] == ["index.pt", "model-extras.pt", "rank-00000.pt", "rank-00001.pt"]
        assert contents["record"] == {"optimizers": ["optimizer-0"], "world_size": 2}
        assert list(contents["optimizer_states"][0]) == ["zeroimpl"] and contents["has_scheduler"]


def test_trainer_removes_the_shards_of_a_checkpoint_it_drops(ranks):
    """ModelCheckpoint(save_top_k=1, save_last="link") removes the first epoch's checkpoint directory, shards and
    all, and links last.ckpt to the second's."""
    for listing in case_results(ranks[0], "kept_one"):
        assert listing == [("epoch=1-step=8.ckpt", True, False), ("last.ckpt", True, True)]


def test_trainer_resume_without_shards_raises(ranks):
    for message in case_results(ranks[0], "missing_shards"):
        assert "epoch=0.ckpt" in message and "is missing" in message and "optimizer-0" in message


def test_trainer_refuses_fp16_parameters(ranks):
    for message in case_results(ranks[0], "fp16_parameters"):
        assert "16-true" in message


def test_trainer_resume_on_one_device(ranks):
    """Saved at 2 devices after epoch 0, resumed at 1 device with accumulate_grad_batches=2 (the same batches per
    step): the weights reach the uninterrupted 2-device run's within RESUME_ON_ONE_ATOL (summation order; the
    BatchNorm statistics follow one device's micro-batches, so buffers are not compared)."""
    two, one = ranks
    resumed, whole = case_result(one, "resumed_on_one"), case_result(two[0], "zero2")
    assert resumed["world_size"] == 1 and resumed["step"] == whole["step"]
    assert resumed["learning_rates"] == whole["learning_rates"][len(whole["learning_rates"]) // 2:]
    names = [n for n in whole["state"] if n.split(".")[-1] in ("weight", "bias")]
    difference = max_difference(resumed, whole, names)
    print(f"resumed on one device: max |difference| {difference}")
    assert difference <= RESUME_ON_ONE_ATOL


def test_strategy_refuses_unknown_options():
    from zeroimpl.integrations.lightning import FabricZeroStrategy, ZeroStrategy

    for strategy in (ZeroStrategy, FabricZeroStrategy):
        with pytest.raises(TypeError, match="bucket_numl"):
            strategy(bucket_numl=1024)


def test_registration_names_the_zero_strategies_and_leaves_lightnings_own_names():
    """Importing the module registers zero1, zero2 and zero2_offload for the Trainer and Fabric through the
    strategies' register_strategies, with their options; DDPStrategy's names (which the subclasses would inherit)
    stay Lightning's."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from zeroimpl.integrations.lightning import FabricZeroStrategy, ZeroStrategy

    for registry, ours, ddp in ((StrategyRegistry, ZeroStrategy, DDPStrategy),
                                (STRATEGY_REGISTRY, FabricZeroStrategy, FabricDDPStrategy)):
        for name, options in REGISTERED.items():
            assert registry[name]["strategy"] is ours and registry[name]["init_params"] == options
        assert registry["ddp"]["strategy"] is ddp


def test_16_mixed_on_cpu_becomes_bf16_with_sharded_clipping():
    """What Lightning does with precision="16-mixed" on CPU, under this strategy as under DDP: bf16-mixed (with a
    warning); the plugin keeps its class and clips through ShardedOptimizer (no ranks needed to construct)."""
    import lightning
    from lightning.pytorch.plugins.precision import MixedPrecision

    from zeroimpl.integrations.lightning import ShardedClipping

    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="zero2", precision="16-mixed",
                                    logger=False, enable_progress_bar=False)
    assert trainer.precision == "bf16-mixed"
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, ShardedClipping) and plugin.scaler is None


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload"])
def test_fabric_matches_ddp_bitwise(ranks, name):
    """Fabric(strategy=...) with fabric.setup(model, optimizer, scheduler=...) (zero2: setup_module, then
    setup_optimizers and a scheduler over the set-up optimizer) against Fabric's DDPStrategy: bitwise."""
    compare(ranks, ("fabric", name), ("fabric", "ddp"))
    for run in case_results(ranks[0], ("fabric", name)):
        assert run["model"] == "Sequential" and run["optimizer"] == "ShardedOptimizer"
        assert run["strategy"] == "FabricZeroStrategy" and run["options"] == {"offload": None, **REGISTERED[name]}
        assert run["groups"] == [("AdamW", 0.1, (0.9, 0.999)), ("AdamW", 0.0, (0.9, 0.999))]


def test_fabric_a_scheduler_over_the_torch_optimizer_drives_the_sharded_one(ranks):
    """A SequentialLR built over the torch optimizer before fabric.setup, not handed to it: its children set the
    ShardedOptimizer's learning rates (ShardedOptimizer.from_optimizer hands the groups over), bitwise as DDP."""
    compare(ranks, ("fabric", "zero2_scheduler_kept"), ("fabric", "ddp_scheduler_kept"))


def test_fabric_no_backward_sync(ranks):
    compare(ranks, ("fabric", "zero1_accumulate"), ("fabric", "ddp_accumulate"))
    compare(ranks, ("fabric", "zero2_accumulate"), ("fabric", "ddp_accumulate"), ACCUMULATION_ATOL)


def test_fabric_clipping_and_mixed_precision(ranks):
    compare(ranks, ("fabric", "zero2_clip_norm"), ("fabric", "ddp_clip_norm"), CLIP_ATOL)
    compare(ranks, ("fabric", "zero2_bf16"), ("fabric", "ddp_bf16"), MIXED_ATOL)
    compare(ranks, ("fabric", "zero2_fp16"), ("fabric", "ddp_fp16"), MIXED_ATOL)
    zero, ddp = (case_result(ranks[0][0], ("fabric", n)) for n in ("zero2_fp16", "ddp_fp16"))
    assert zero["scale"] == ddp["scale"] < FP16_INITIAL_SCALE


def test_fabric_clips_the_unscaled_fp16_gradients(ranks):
    """fp16 with clipping by norm: fabric.clip_gradients unscales before it measures the norm, as Fabric's DDP
    does (clipping the still-scaled gradients would leave them unclipped by the scale's factor)."""
    compare(ranks, ("fabric", "zero2_fp16_clip_norm"), ("fabric", "ddp_fp16_clip_norm"), CLIP_ATOL)
    zero, ddp = (case_result(ranks[0][0], ("fabric", n)) for n in ("zero2_fp16_clip_norm", "ddp_fp16_clip_norm"))
    assert zero["scale"] == ddp["scale"] < FP16_INITIAL_SCALE


def test_fabric_save_and_load(ranks):
    """fabric.save after epoch 0 and fabric.load into a new model and optimizer: the state's plain value (the epoch
    to start from) comes back, and the second epoch is bitwise the uninterrupted run's; a copy of the checkpoint
    directory without its shard folders raises on load."""
    two, _ = ranks
    for resumed, whole in zip(case_results(two, ("fabric", "resumed")), case_results(two, ("fabric", "zero2"))):
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        assert max_difference(resumed, whole, [n for n in whole["state"] if "num_batches" not in n]) == 0.0
    for message in case_results(two, ("fabric", "missing_shards")):
        assert "is missing" in message



def test_fabric_ddp_with_a_stage_1_sharded_optimizer_trains_saves_and_loads_bitwise(ranks):
    """Fabric(strategy=DDPStrategy()) and fabric.setup(model, ShardedOptimizer(stage=1), scheduler): bitwise Fabric's
    DDP + AdamW; fabric.save consolidates the state on rank 0 (Fabric calls consolidate_state_dict), and fabric.load
    on every rank continues the second epoch bitwise as the uninterrupted run."""
    compare(ranks, ("fabric", "ddp_sharded"), ("fabric", "ddp"))
    two, _ = ranks
    for resumed, whole in zip(case_results(two, ("fabric", "ddp_sharded_resumed")),
                              case_results(two, ("fabric", "ddp_sharded"))):
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        assert max_difference(resumed, whole, [n for n in whole["state"] if "num_batches" not in n]) == 0.0
