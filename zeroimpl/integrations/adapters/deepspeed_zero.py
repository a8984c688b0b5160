"""DeepSpeed ZeRO stage 1 or 2 (DeepSpeedZeroOptimizer), optionally with optimizer offload to the CPU.

Configured as a DeepSpeed user would: the optimizer comes from the config (torch's AdamW without offload,
DeepSpeedCPUAdam with offload, as DeepSpeed chooses; with ``optimizer="muon"`` DeepSpeed's own Muon, which
picks its matrices itself -- every parameter of 2 or more dimensions whose name has neither "embed" nor
"lm_head" -- with the standard Newton-Schulz iteration that torch.optim.Muon runs), the engine scales the
loss by the accumulation steps, clips and steps at the accumulation boundary.

With ``optimizer="adamw8bit"`` DeepSpeed has no 8-bit optimizer of its own: it takes bitsandbytes' AdamW8bit as
a client optimizer only with ``zero_allow_untested_optimizer`` (and, with offload, ``zero_force_ds_cpu_optimizer``
off), which this row sets, and then steps its flat fp32 partition as one tensor: quantization blocks cross
parameter boundaries and the 8-bit size threshold applies to the partition, not to each parameter.
"""

from __future__ import annotations

import os

import torch

from ..models import param_groups
from .base import Implementation, Runner, TrainSettings
from .loop import on_device, optimizer_state_tensors, replicated_parameters

# DeepSpeedZeroOptimizer attributes (0.19) that hold tensors, by kind
GRADIENT_ATTRIBUTES = ("averaged_gradients", "grads_in_partition", "accumulated_grads_in_cpu")
# fixed staging buffers (the largest parameter's size, for offload copies) and the reduction bucket
BUFFER_ATTRIBUTES = ("ipg_buffer", "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload")


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor inside nested lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


class DeepSpeedRunner(Runner):
    def __init__(self, engine, model: torch.nn.Module, device: torch.device):
        self.engine = engine
        self.model = model
        self.device = device

    def backward(self, micro_batches: list[dict]) -> list[float]:
        losses = []
        for index, batch in enumerate(micro_batches):
            loss = self.engine(**on_device(batch, self.device)).loss
            self.engine.backward(loss)  # divides by the accumulation steps itself
            if index < len(micro_batches) - 1:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
            losses.append(loss.item())
        return losses

    def step(self) -> None:
        self.engine.step()  # the boundary: clip (config gradient_clipping), step, zero the gradients

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return replicated_parameters(self.model)  # ZeRO-1/2 all-gather the parameters after every step

    def model_state(self) -> dict[str, list[torch.Tensor]]:
        zero = self.engine.optimizer
        params = list(self.model.parameters())
        masters = tensors_in(zero.single_partition_of_fp32_groups)
        gradients = [p.grad for p in params + masters if p.grad is not None]
        gradients += [t for name in GRADIENT_ATTRIBUTES for t in tensors_in(getattr(zero, name, None))]
        return {"parameters": tensors_in(zero.bit16_groups_flat) + params, "gradients": gradients,
                "optimizer_state": optimizer_state_tensors(zero.optimizer), "master_weights": masters,
                "buffers": [t for name in BUFFER_ATTRIBUTES for t in tensors_in(getattr(zero, name, None))]
                + list(self.model.buffers())}


class DeepSpeed(Implementation):
    modules = ("deepspeed",)
    install_hint = "pip install --no-build-isolation deepspeed==0.19.8 (after torch)"

    def __init__(self, stage: int, offload: bool = False):
        self.stage, self.offload = stage, offload
        self.name = f"DeepSpeed ZeRO-{stage}" + (" + offload" if offload else "")

    def environment(self, device: str) -> dict[str, str]:
        return {"DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}  # the run's device, not the machine's

    def config(self, settings: TrainSettings, world_size: int, device: torch.device) -> dict:
        zero = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        adamw = {"lr": settings.lr, "betas": list(settings.betas), "eps": settings.eps,
                 "weight_decay": settings.weight_decay}
        if not self.offload:
            adamw["torch_adam"] = True  # torch.optim.AdamW, as the other rows (FusedAdam needs CUDA)
        optimizer = {"type": "AdamW", "params": adamw}
        if settings.optimizer == "adamw8bit":  # a client optimizer (build): DeepSpeed refuses it without these
            return {**self._common(settings, world_size), "zero_optimization": zero,
                    "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
        if settings.optimizer == "muon":
            muon = {"muon_lr": settings.muon_lr, "momentum": 0.95, "ns_method": "standard"}
            optimizer = {"type": "Muon", "params": {**adamw, **muon}}
        return {**self._common(settings, world_size), "optimizer": optimizer, "zero_optimization": zero}

    @staticmethod
    def _common(settings: TrainSettings, world_size: int) -> dict:
        precision = {"bf16": {"enabled": True}} if settings.precision == "bf16" else {}
        return {**precision, "train_micro_batch_size_per_gpu": settings.micro_batch_size,
                "gradient_accumulation_steps": settings.accum,
                "train_batch_size": settings.micro_batch_size * settings.accum * world_size,
                "gradient_clipping": settings.max_grad_norm or 0.0, "steps_per_print": 10 ** 9,
                "wall_clock_breakdown": False}

    def build(self, model, settings: TrainSettings, device) -> DeepSpeedRunner:
        import deepspeed
        import torch.distributed as dist

        groups = param_groups(model, settings.weight_decay)
        config = self.config(settings, dist.get_world_size(), device)
        if settings.optimizer == "adamw8bit":  # a client optimizer: DeepSpeed has no 8-bit one
            client = settings.adamw_class()(groups, **settings.adamw_kwargs())
            engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config)
        else:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        return DeepSpeedRunner(engine, model, device)


CPU_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")  # offload's DeepSpeedCPUAdam; the CPU accelerator's collectives


def build_cpu_ops() -> list[str]:
    """Build the ops DeepSpeed's CPU runs load (``CPU_OPS``, those this machine can build, as DeepSpeed itself
    skips an incompatible one) into torch's extension cache now (``zeroimpl-compare --build-deepspeed-ops``), as
    ``DS_BUILD_OPS=1`` would at install (which here took 3.5 min against 1.4 for this, 2 cores), rather than
    inside the first comparison that needs them. Later runs find them built: the cache is per user, Python version
    and torch build (CPU or CUDA). Needs a C++ compiler and ninja, as DeepSpeed's own first run does. Returns the
    names of the ops built."""
    previous = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"  # read once, at deepspeed's first get_accelerator()
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    finally:
        if previous is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = previous
    if accelerator.device_name() != "cpu":
        raise RuntimeError(f"DeepSpeed's accelerator in this process is already {accelerator.device_name()!r}: build "
                           "its CPU ops in a fresh process (zeroimpl-compare --build-deepspeed-ops)")
    builders = [accelerator.create_op_builder(name) for name in CPU_OPS]
    built = [builder for builder in builders if builder is not None and builder.is_compatible(verbose=False)]
    for builder in built:
        builder.load()
    return [builder.NAME for builder in built]
