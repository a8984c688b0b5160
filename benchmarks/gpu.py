"""The GPU benchmark: zeroimpl against its peers on CUDA, in one command per section (NCCL, one rank per GPU).

    python benchmarks/gpu.py                           # every section (well over 10 minutes on one GPU)
    python benchmarks/gpu.py --sections comparison --only zeroimpl    # zeroimpl's rows beside DDP
    python benchmarks/gpu.py --sections largest --largest zeroimpl    # zeroimpl's ladder alone
    python benchmarks/gpu.py --dry-run                 # the same code on CPU (gloo, tiny models), a minute

Writes ``benchmarks/results/gpu/`` (``--out``):

1. ``comparison``: the comparison harness (``zeroimpl-compare --device cuda --precision bf16``) on GPT-2 350m
   (0.34B parameters) in bf16, world size = the GPUs present: zeroimpl stage 1, stage 2 and stage 1/2 +
   offload against DDP, PyTorch ZeRO, FairScale and DeepSpeed ZeRO-1/2 (+ offload), whichever are installed;
   step time (median after warm-up) and CUDA peak per rank, as ratios to DDP in the same run, and each
   row's verdict against DDP. -> ``comparison.md`` (rewritten as each row finishes; .csv, .json, .png at the
   end). At 1B parameters each row took 47-65 s on one H200 (start-up, saving and comparing the parameters:
   ``results/gpu/comparison-attempt.md``), so 11 rows outran a 15-minute lease: 350m, a third of the parameters, is meant to fit 5 minutes (not yet
   measured on a GPU).
2. ``knobs``: zeroimpl stage 2 on the same model, the parameter all-gather overlapped with the next forward
   (the default) or waited for in ``step()``, and the reduce-scatter window ``max_inflight_buckets`` 2 (the
   default: the host waits for reduce-scatter i-2, polling, and the compute stream runs on), 8 and 64, against
   DDP under autocast;
   median step time and CUDA peak. -> ``knobs.md``
3. ``largest``: LLaMA configurations of growing size in bf16, micro-batch 1 of 512 tokens, two steps each,
   with stage 2 + CPU offload on one GPU, and DeepSpeed ZeRO-2 + offload the same way; a configuration
   passes when both steps end with a finite loss; each implementation stops at its first failure (CUDA or
   host out of memory, or any error). Host memory bounds both: about 16 bytes per parameter, so a
   configuration that needs more than 90% of the host's memory is not tried. zeroimpl's ladder took 240 s on
   one H200 (1.35B, 3.38B, 6.74B). -> ``largest.md``

4. ``offload``: zeroimpl stage 2 + offload against DeepSpeed ZeRO-2 + offload (its CPU Adam) on one device,
   LLaMA-style about 1.3B and 6.7B in bf16 (a run that would not fit the host is not tried), 4 micro-batches of
   2 x 1024 tokens per step, AdamW, clipping: tokens/s, model TFLOPS, the phases, host bytes per parameter and
   CUDA peak, each row appended as it finishes. -> ``offload.md``. ``benchmarks/gpu_call.sh`` prepares and runs it.

DeepSpeed and FairScale are optional: rows for a missing one say how to install it. On a machine without
internet, build their wheels where pip works (``pip wheel --no-deps deepspeed==0.19.8 fairscale==0.4.13``)
and install them there.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl.integrations.launch import run_distributed, start_ranks_from_forkserver  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "gpu")
SECTIONS = ("comparison", "knobs", "largest", "offload")
# (hidden, layers): LLaMA-style, intermediate 2.6875 x hidden, vocabulary 32000; about 1.3B, 3.4B, 6.7B, 13B
LADDER = [(2048, 24), (3072, 28), (4096, 32), (5120, 40)]
DRY_LADDER = [(64, 2)]  # (one rung: the ladder's code is the same at every rung)
LARGEST_IMPLEMENTATIONS = ("zeroimpl", "deepspeed")
OFFLOAD_NAMES = {"zeroimpl": "zeroimpl stage 2 + offload", "deepspeed": "DeepSpeed ZeRO-2 + offload"}
# offload's host bytes per parameter: fp32 master, gradient shard and two AdamW moments (both implementations)
HOST_BYTES_PER_PARAMETER = 16


def _machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}, gloo"


# -- 1. the comparison ---------------------------------------------------------------------------------
def comparison(out: str, device: str, world_size: int, size: str, steps: int, only: list[str] | None) -> str:
    from zeroimpl.integrations.adapters import TrainSettings, all_implementations
    from zeroimpl.integrations.comparison.compare import compare
    from zeroimpl.integrations.comparison.harness import Workload

    workload = Workload("gpt2", size, world_size, steps, settings=TrainSettings(precision="bf16"), device=device)
    command = (f"python benchmarks/gpu.py --sections comparison{' --only ' + shlex.join(only) if only else ''} "
               f"(gpt2 {size}, {world_size} rank(s))")
    compare(workload, out, all_implementations(only), progress=print, command=command)
    return os.path.join(out, "comparison.md")


# -- 2. zeroimpl's knobs -------------------------------------------------------------------------------
KNOBS = {
    "DDP, autocast bf16": None,
    "zeroimpl stage 2 (defaults: overlapped all-gather, window 2)": {},
    "zeroimpl stage 2, all-gather waited for in step()": {"overlap_param_gather": False},
    "zeroimpl stage 2, window 8": {"max_inflight_buckets": 8},
    "zeroimpl stage 2, window 64": {"max_inflight_buckets": 64},
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _knob_rank(rank: int, world_size: int, size: str, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from zeroimpl import ShardedOptimizer
    from zeroimpl.integrations.models import batch, build_model, param_groups

    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, knobs in KNOBS.items():
        model = build_model("gpt2", size).to(device)
        if knobs is None:
            forward_module = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4)

            def forward(micro, forward_module=forward_module):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return forward_module(**micro).loss
            backward = torch.Tensor.backward
        else:
            model.to(torch.bfloat16)
            optimizer = ShardedOptimizer(param_groups(model, 0.01), torch.optim.AdamW, stage=2, lr=1e-4, **knobs)

            def forward(micro, model=model):
                return model(**micro).loss
            backward = optimizer.backward
        times = []
        for step in range(steps):
            micro = {k: v.to(device) for k, v in batch("gpt2", size, rank, step, 0, 4).items()}
            if step == 1:
                _peak_reset(device)
            _synchronize(device)
            started = time.perf_counter()
            backward(forward(micro))
            optimizer.step()
            optimizer.zero_grad()
            _synchronize(device)
            if step >= 1:
                times.append(time.perf_counter() - started)
        results[name] = (statistics.median(times), _peak(device))
        del model, optimizer, forward
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def knobs(out: str, device: str, world_size: int, size: str, steps: int) -> str:
    backend = "nccl" if device == "cuda" else "gloo"
    by_rank = run_distributed(world_size, _knob_rank, size, steps, backend=backend, timeout=1800)
    seconds = {name: max(r[name][0] for r in by_rank) for name in KNOBS}  # the slowest rank sets the pace
    peaks = {name: max(r[name][1] for r in by_rank) for name in KNOBS}
    ddp = seconds["DDP, autocast bf16"]
    rows = [f"| {name} | {seconds[name] * 1e3:.1f} | {seconds[name] / ddp:.3f} | {peaks[name] / 2 ** 20:.0f} |"
            for name in KNOBS]
    text = "\n".join([
        "# zeroimpl's overlap knobs on the GPU", "",
        f"{_machine(device)}; {world_size} rank(s); `python benchmarks/gpu.py --sections knobs`: GPT-2 {size} "
        f"(zeroimpl: bf16 parameters, fp32 master shards; DDP: fp32 model under autocast), micro-batch 4, AdamW, "
        f"median step time (forward + backward + step) of the slowest rank over {steps - 1} steps after one "
        "warm-up, and the CUDA peak (max_memory_allocated) past the warm-up.", "",
        "| run | step ms | / DDP | CUDA peak MiB |", "| --- | --- | --- | --- |", *rows, ""])
    path = os.path.join(out, "knobs.md")
    with open(path, "w") as handle:
        handle.write(text)
    return path


# -- 3. the largest model that trains ------------------------------------------------------------------
def _llama(hidden: int, layers: int, device: torch.device, positions: int = 512) -> torch.nn.Module:
    """A LLaMA of ``hidden`` x ``layers`` built in bf16 directly on ``device`` (seeded)."""
    import transformers

    heads = max(1, hidden // 128)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                                      intermediate_size=int(hidden * 2.6875) // 64 * 64, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=positions,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _deepspeed_offload(model: torch.nn.Module, device: torch.device, sequences: int = 1, micro_batches: int = 1,
                       clipping: float = 0.0):
    """DeepSpeed ZeRO-2 + CPU offload (its CPU Adam) over ``model`` in bf16: AdamW at lr 1e-5, weight decay 0.01
    on the matrices, ``micro_batches`` of ``sequences`` per step, clipping at ``clipping`` (0: none)."""
    import deepspeed

    from zeroimpl.integrations.models import param_groups

    config = {"train_micro_batch_size_per_gpu": sequences, "gradient_accumulation_steps": micro_batches,
              "bf16": {"enabled": True}, "gradient_clipping": clipping,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                      "pin_memory": device.type == "cuda"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=config)
    return engine


def _largest_rank(rank: int, world_size: int, implementation: str, hidden: int, layers: int, tokens: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _llama(hidden, layers, device)
    parameters = sum(p.numel() for p in model.parameters())
    from zeroimpl.integrations.models import param_groups

    ids = torch.randint(2, 32000, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    if implementation == "zeroimpl":
        from zeroimpl import ShardedOptimizer

        optimizer = ShardedOptimizer(param_groups(model, 0.01), torch.optim.AdamW, stage=2, offload="cpu", lr=1e-5)
        forward, backward, step = model, optimizer.backward, optimizer.step
    else:
        engine = _deepspeed_offload(model, device)
        forward, backward, step = engine, engine.backward, engine.step
    losses, started = [], time.perf_counter()
    for _ in range(2):
        loss = forward(input_ids=ids, labels=ids).loss
        backward(loss)
        step()
        losses.append(loss.item())
    return {"parameters": parameters, "losses": losses, "seconds": (time.perf_counter() - started) / 2,
            "peak": _peak(device)}


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _attempt(implementation: str, hidden: int, layers: int, device: str, tokens: int) -> tuple[bool, str, dict]:
    env = {"DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}
    try:
        result = run_distributed(1, _largest_rank, implementation, hidden, layers, tokens, timeout=900,
                                 backend="nccl" if device == "cuda" else "gloo", env=env)[0]
    except AssertionError as error:  # a rank raised, died (the host's out-of-memory killer) or hung
        text = str(error)
        kind = ("CUDA out of memory" if "CUDA out of memory" in text or "OutOfMemoryError" in text else
                "host out of memory" if "MemoryError" in text or "exit code -9" in text or "killed" in text else
                "timed out" if "timed out" in text else "failed: " + text.strip().splitlines()[-1][:200])
        return False, kind, {}
    finite = all(torch.isfinite(torch.tensor(result["losses"])))
    return finite, "trains" if finite else "non-finite loss", result


def largest(out: str, device: str, ladder: list[tuple[int, int]], tokens: int,
            implementations: tuple[str, ...] = LARGEST_IMPLEMENTATIONS) -> str:
    import importlib.util

    rows = []
    for implementation in LARGEST_IMPLEMENTATIONS:
        name = OFFLOAD_NAMES[implementation]
        if implementation not in implementations:
            rows.append(f"| {name} | - | - | not tried in this run (--largest {' '.join(implementations)}) | - | - |")
            continue
        if implementation == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            rows.append(f"| {name} | - | - | skipped: pip install --no-build-isolation deepspeed==0.19.8 | - | - |")
            continue
        for hidden, layers in ladder:
            started = time.monotonic()
            needed = HOST_BYTES_PER_PARAMETER * sum(p.numel() for p in _llama(hidden, layers, torch.device("meta"))
                                                    .parameters())
            if needed > 0.9 * _host_memory():  # the host's out-of-memory killer would end it, slowly
                rows.append(f"| {name} | {hidden} x {layers} | {needed / HOST_BYTES_PER_PARAMETER / 1e9:.2f}B | not "
                            f"tried: needs about {needed / 2 ** 30:.0f} GiB of host memory | - | - |")
                break
            ok, outcome, result = _attempt(implementation, hidden, layers, device, tokens)
            size = f"{result['parameters'] / 1e9:.2f}B" if result else "-"
            step = f"{result['seconds']:.1f}" if result else "-"
            peak = f"{result['peak'] / 2 ** 30:.1f}" if result else "-"
            rows.append(f"| {name} | {hidden} x {layers} | {size} | {outcome} ({time.monotonic() - started:.0f} s) "
                        f"| {step} | {peak} |")
            print(rows[-1], flush=True)
            if not ok:
                break
    text = "\n".join([
        "# The largest model that trains with stage 2 + CPU offload on one GPU", "",
        f"{_machine(device)}; host memory {_host_memory() / 2 ** 30:.0f} "
        f"GiB; `python benchmarks/gpu.py --sections largest --largest {' '.join(implementations)}`: LLaMA-style "
        "configurations (hidden x layers, "
        f"vocabulary 32000) in bf16, one sequence of {tokens} tokens, AdamW; two steps each, in a fresh process; "
        "each implementation stops at its first failure.", "",
        "| implementation | hidden x layers | parameters | outcome | s / step | CUDA peak GiB |",
        "| --- | --- | --- | --- | --- | --- |", *rows, ""])
    path = os.path.join(out, "largest.md")
    with open(path, "w") as handle:
        handle.write(text)
    return path


# -- 4. offload against DeepSpeed's ---------------------------------------------------------------------
OFFLOAD_LADDER = [(2048, 24), (4096, 32)]  # LLaMA-style, about 1.3B and 6.7B
DRY_OFFLOAD_LADDER = [(64, 2)]
OFFLOAD_BATCH = (2, 1024, 4)  # sequences per micro-batch, tokens per sequence, micro-batches per step: 8 x 1024
DRY_OFFLOAD_BATCH = (1, 16, 2)
# host bytes per parameter assumed when deciding whether a run fits the host: zeroimpl's fp32 master, gradient
# and two moments and its bf16 staging (18, the goal); DeepSpeed's measured 28 (its issue #7693)
OFFLOAD_HOST_BYTES = {"zeroimpl": 18, "deepspeed": 28}
PHASES = ("forward", "backward", "step")


def _resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak so far (``VmHWM``), from /proc/self/status."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _offload_rank(rank: int, world_size: int, implementation: str, hidden: int, layers: int,
                  batch: tuple[int, int, int], steps: int) -> dict:
    """One process, one device: ``steps`` steps of ``batch`` (sequences, tokens, micro-batches) with AdamW and
    clipping at 1.0. Step 0 warms up; step 1 synchronizes the device at each phase's end (forward, backward
    with the gradients' copies to the host, step: the host's AdamW and the parameters' copies back and
    gathers) and times the phases; the later steps synchronize only at their end and give the step time. Host
    bytes: the peak resident memory past start-up (the imports, the CUDA context and cuBLAS loaded: before the
    model) over the parameters. With them, the loss of the last step's last micro-batch."""
    import transformers  # noqa: F401 - (loaded before the start-up's resident memory is read)

    from zeroimpl.integrations.models import param_groups

    if implementation == "deepspeed":
        import deepspeed  # noqa: F401
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warm = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (warm @ warm).sum().item()  # the CUDA context and cuBLAS, out of the host bytes counted
    sequences, tokens, micro_batches = batch
    started_resident = _resident_bytes()
    model = _llama(hidden, layers, device, positions=tokens)
    parameters = sum(p.numel() for p in model.parameters())

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, 32000, (sequences, tokens), generator=generator).to(device) for _ in range(micro_batches)]
    if implementation == "zeroimpl":
        from zeroimpl import ShardedOptimizer

        optimizer = ShardedOptimizer(param_groups(model, 0.01), torch.optim.AdamW, stage=2, offload="cpu", lr=1e-5)

        def forward(micro):
            return model(input_ids=micro, labels=micro).loss / micro_batches

        def backward(loss, last):
            if last:
                optimizer.backward(loss)
            else:
                with optimizer.accumulating():
                    optimizer.backward(loss)

        def step():
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
    else:
        engine = _deepspeed_offload(model, device, sequences, micro_batches, clipping=1.0)

        def forward(micro):
            return engine(input_ids=micro, labels=micro).loss

        def backward(loss, last):
            engine.backward(loss)
            if not last:
                engine.step()  # (inside the accumulation: DeepSpeed's step only counts the micro-batch)

        def step():
            engine.step()
    phases, step_seconds = dict.fromkeys(PHASES, 0.0), []
    for index in range(steps):
        timed_phases = index == 1
        if index == 1:
            _peak_reset(device)
        _synchronize(device)
        started = time.perf_counter()
        for number, micro in enumerate(ids):
            mark = time.perf_counter()
            loss = forward(micro)
            if timed_phases:
                _synchronize(device)
                phases["forward"] += time.perf_counter() - mark
                mark = time.perf_counter()
            backward(loss, number == micro_batches - 1)
            if timed_phases:
                _synchronize(device)
                phases["backward"] += time.perf_counter() - mark
        mark = time.perf_counter()
        step()
        _synchronize(device)
        if timed_phases:
            phases["step"] = time.perf_counter() - mark
        elif index >= 2:
            step_seconds.append(time.perf_counter() - started)
    return {"parameters": parameters, "tokens": sequences * tokens * micro_batches, "phases": phases,
            "step_seconds": statistics.median(step_seconds),
            # (zeroimpl's forward divides by the micro-batches, DeepSpeed's backward does)
            "loss": loss.item() * (micro_batches if implementation == "zeroimpl" else 1), "peak": _peak(device),
            "host_bytes": _resident_bytes("VmHWM") - started_resident}


def _offload_row(name: str, shape: str, result: dict) -> str:
    seconds, tokens, parameters = result["step_seconds"], result["tokens"], result["parameters"]
    phases = " / ".join(f"{result['phases'][phase]:.2f}" for phase in PHASES)
    return (f"| {name} | {shape} | {parameters / 1e9:.2f}B | {tokens / seconds:,.0f} | "
            f"{6 * parameters * tokens / seconds / 1e12:.1f} | {seconds:.2f} | {phases} | "
            f"{result['host_bytes'] / parameters:.1f} | {result['peak'] / 2 ** 30:.1f} | {result['loss']:.4f} |")


def offload(out: str, device: str, ladder: list[tuple[int, int]], batch: tuple[int, int, int], steps: int,
            implementations: tuple[str, ...] = LARGEST_IMPLEMENTATIONS) -> str:
    """zeroimpl stage 2 + offload against DeepSpeed ZeRO-2 + offload on one device, each size and implementation
    in a fresh process; ``offload.md`` holds the header from the start and gains each row as it finishes, so
    that a run cut short keeps what ran."""
    import importlib.util

    sequences, tokens, micro_batches = batch
    path = os.path.join(out, "offload.md")
    with open(path, "w") as handle:
        handle.write("\n".join([
            "# Offload on one device: zeroimpl stage 2 + offload against DeepSpeed ZeRO-2 + offload", "",
            f"{_machine(device)}; host memory {_host_memory() / 2 ** 30:.0f} GiB; `python benchmarks/gpu.py "
            f"--sections offload`: LLaMA-style models in bf16 (vocabulary 32000), {micro_batches} micro-batches of "
            f"{sequences} x {tokens} tokens per step, AdamW (weight decay 0.01 on the matrices), clipping at 1.0; "
            f"{steps} steps in a fresh process per row: one warm-up, one timed by phase (the device synchronized at "
            "each phase's end, so nothing overlaps across them; backward includes the gradients' copies to the "
            "host, step the host's AdamW and the parameters' copies back), the rest timed whole (their median gives "
            "tokens/s and model TFLOPS = 6 x parameters x tokens / s). Host bytes per parameter: the peak resident "
            "memory past start-up over the parameters. Each row is written when it finishes.", "",
            "| implementation | hidden x layers | parameters | tokens/s | model TFLOPS | s / step | "
            "phases s: forward / backward / step | host bytes / parameter | CUDA peak GiB | last loss |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", ""]))
    for hidden, layers in ladder:
        count = sum(p.numel() for p in _llama(hidden, layers, torch.device("meta")).parameters())
        for implementation in LARGEST_IMPLEMENTATIONS:
            name, shape = OFFLOAD_NAMES[implementation], f"{hidden} x {layers}"
            needed = OFFLOAD_HOST_BYTES[implementation] * count
            if implementation not in implementations:
                row = f"| {name} | {shape} | {count / 1e9:.2f}B | not tried in this run | | | | | | |"
            elif implementation == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                row = f"| {name} | {shape} | {count / 1e9:.2f}B | skipped: DeepSpeed is not installed | | | | | | |"
            elif needed > 0.9 * _host_memory():
                row = (f"| {name} | {shape} | {count / 1e9:.2f}B | not tried: about {needed / 2 ** 30:.0f} GiB of "
                       f"host memory ({OFFLOAD_HOST_BYTES[implementation]} bytes per parameter) | | | | | | |")
            else:
                env = {"DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}
                try:
                    result = run_distributed(1, _offload_rank, implementation, hidden, layers, batch, steps,
                                             timeout=900, backend="nccl" if device == "cuda" else "gloo", env=env)[0]
                    row = _offload_row(name, shape, result)
                except AssertionError as error:  # a rank raised, died or hung: the row says so, the next runs
                    last = str(error).strip().splitlines()[-1][:200] if str(error).strip() else "no message"
                    row = f"| {name} | {shape} | {count / 1e9:.2f}B | failed: {last} | | | | | | |"
            print(row, flush=True)
            with open(path, "a") as handle:
                handle.write(row + "\n")
    return path


def _three_or_more(text: str) -> int:
    if not text.isdigit() or int(text) < 3:
        raise argparse.ArgumentTypeError(f"{text!r}: section 4 needs 3 steps or more (a warm-up, one timed by phase, "
                                         "one timed whole)")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--steps", type=int, default=6, help="steps per run of sections 1 and 2 (the first untimed)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="section 1: only the rows whose name contains one of these (DDP always runs)")
    parser.add_argument("--largest", nargs="+", choices=LARGEST_IMPLEMENTATIONS, default=list(LARGEST_IMPLEMENTATIONS),
                        help="the implementations section 3 climbs the ladder with (each takes minutes per rung)")
    parser.add_argument("--offload", nargs="+", choices=LARGEST_IMPLEMENTATIONS, default=list(LARGEST_IMPLEMENTATIONS),
                        help="the implementations section 4 runs at each size")
    parser.add_argument("--offload-steps", type=_three_or_more, default=4, metavar="N",
                        help="steps per row of section 4: a warm-up, one timed by phase, the rest timed whole")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, gloo, tiny models (2 ranks; offload and largest: 1): check the script, measure nothing")
    args = parser.parse_args()
    if args.only:
        from zeroimpl.integrations.adapters import all_implementations

        try:
            all_implementations(args.only)
        except ValueError as error:  # checked before any section runs
            parser.error(str(error))
    if args.dry_run:
        device, world_size, size, ladder, tokens = "cpu", 2, "tiny", DRY_LADDER, 16
        offload_ladder, offload_batch = DRY_OFFLOAD_LADDER, DRY_OFFLOAD_BATCH
    elif torch.cuda.is_available():
        device, world_size, size, ladder, tokens = "cuda", torch.cuda.device_count(), "1b", LADDER, 512
        offload_ladder, offload_batch = OFFLOAD_LADDER, OFFLOAD_BATCH
    else:
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (or --dry-run)")
    os.makedirs(args.out, exist_ok=True)
    # gloo ranks (--dry-run) fork from one server that has imported these, not a new interpreter each (NCCL
    # ranks are spawned whatever this says: launch.start_ranks_from_forkserver)
    start_ranks_from_forkserver(["torch", "torch.distributed", "transformers",
                                 "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"])
    for section in args.sections:
        started = time.monotonic()
        if section == "comparison":
            path = comparison(args.out, device, world_size, "350m" if device == "cuda" else size, args.steps,
                              args.only)
        elif section == "knobs":
            path = knobs(args.out, device, world_size, size, args.steps)
        elif section == "largest":
            path = largest(args.out, device, ladder, tokens, tuple(args.largest))
        else:
            path = offload(args.out, device, offload_ladder, offload_batch, args.offload_steps, tuple(args.offload))
        print(f"{section}: wrote {path} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
