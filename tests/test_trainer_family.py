"""zeroimpl in the Trainer family: TRL's SFTTrainer and DPOTrainer and a PEFT (LoRA) model, each trained through
``class ZeroXTrainer(ZeroTrainer, XTrainer)`` against the same trainer class without zeroimpl (which Trainer wraps
in DDP); the other base order refused when the class is defined; and a ShardedOptimizer handed to the plain
Trainer (``optimizers=`` or ``optimizer_cls_and_kwargs=``) refused on every rank, naming ZeroTrainer.

Real processes: 2 ranks, gloo, CPU, every case in one launch (TRL's imports take seconds per rank). Model: LLaMA
(2 layers, width 32) built from a config; tokenizer: a 20-word WordLevel vocabulary in PreTrainedTokenizerFast;
nothing downloaded. 3 optimizer steps of 2 micro-batches of 4 sequences per rank, lr 1e-3, clipping at 1.0.

Tolerances, each against the reference run of the same launch:
* fp32, stage 1: bitwise (it sums each rank's accumulated gradient once per step, in DDP's order).
* fp32, stage 2: it reduces each micro-batch, DDP the accumulated sum, so the summation order differs:
  FP32_ATOL = 1e-6 on every parameter (measured: SFT 3.5e-8, DPO 1.2e-7); logged losses and grad norms
  (the norm computed from the shards in another order) within FP32_RTOL = 1e-5 relative (measured: SFT losses
  equal, DPO losses 9e-8, grad norms 6e-7).
* SFTConfig's defaults (bf16 autocast, which runs on CPU, and gradient checkpointing), the full model and LoRA:
  BF16_REL_L2 = 3e-4, the relative L2 distance of all trainable parameters (measured: 5e-10; LoRA equal). A
  last-bit difference can round an fp32 weight to another bf16 value, and Adam then moves that element by up
  to 2 lr: one such element is about 1.5e-4 of this model's parameter norm (13). bf16 itself moves the
  parameters 9.5e-4 away from the fp32 run, which the test requires to be over the bound, so the bound tells
  bf16 noise from no bf16. Logged losses and grad norms within 1e-4 relative (measured: losses equal, grad
  norms 6e-7).
"""

import functools
import os
import warnings

import pytest
import torch

from distributed import case_results, run_cases, run_distributed

FP32_ATOL = 1e-6
FP32_RTOL = 1e-5
BF16_REL_L2 = 3e-4
STEPS = 3
WORDS = "the a cat dog sat ran on under mat log red blue big small quick slow jumps sleeps".split()
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # the ranks' environment: no network calls


# -- in the ranks: the model, the data, the trainers ------------------------------------------------------
def tiny_tokenizer():
    """A WordLevel tokenizer over WORDS with <pad>, <eos> and <unk>, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(vocab_size: int):
    """The same 2-layer LLaMA (width 32) on every rank and in every run (seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.LlamaForCausalLM(config)


def sentences(count: int, seed: int, prefix: str = "") -> list[str]:
    """``count`` random sentences of 4 to 9 words (seeded, so every rank and run has the same)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 10, (count,), generator=generator)
    return [prefix + " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=generator))
            for n in lengths]


def run_settings(directory: str, fp32: bool, **overrides) -> dict:
    """TrainingArguments keywords shared by every run; ``fp32``: turn off bf16 and gradient checkpointing, which
    TRL's configs default to (``fp32=False`` keeps those defaults)."""
    settings = dict(output_dir=directory, max_steps=STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, seed=0, use_cpu=True, ddp_backend="gloo",
                    report_to=[], save_strategy="no", disable_tqdm=True)
    if fp32:
        settings.update(bf16=False, gradient_checkpointing=False)
    return {**settings, **overrides}


def with_zero(trainer_class):
    """The one-line recipe of docs/trainer.md: ZeroTrainer first, then the trainer class."""
    from zeroimpl.integrations.trainer import ZeroTrainer

    return type(f"Zero{trainer_class.__name__}", (ZeroTrainer, trainer_class), {})


def outcome(trainer) -> dict:
    """What a run left: logged losses, grad norms and learning rates, the trainable parameters, the settings it ran
    with, and what Trainer wrapped the model in."""
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [entry["loss"] for entry in history], "grad_norms": [entry["grad_norm"] for entry in history],
            "learning_rates": [entry["learning_rate"] for entry in history],
            "params": {name: p.detach().float().clone() for name, p in trainer.model.named_parameters()
                       if p.requires_grad},
            "wrapper": type(trainer.model_wrapped).__name__, "bf16": trainer.args.bf16,
            "gradient_checkpointing": trainer.model.is_gradient_checkpointing}


def train_sft(directory: str, zero_stage, fp32: bool = True, lora: bool = False, save_steps: int = 0,
              resume: str = None) -> dict:
    """SFTTrainer on 32 sentences; ``zero_stage=None``: the plain SFTTrainer (DDP), else ZeroSFTTrainer."""
    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    tokenizer = tiny_tokenizer()
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    options = {} if zero_stage is None else {"zero_stage": zero_stage}
    if lora:
        options["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer_class = SFTTrainer if zero_stage is None else with_zero(SFTTrainer)
    trainer = trainer_class(model=tiny_llama(len(tokenizer)), args=SFTConfig(**run_settings(directory, fp32, **saving)),
                            train_dataset=datasets.Dataset.from_dict({"text": sentences(32, seed=0)}),
                            processing_class=tokenizer, **options)
    trainer.train(resume_from_checkpoint=resume)
    return outcome(trainer)


def train_dpo(directory: str, zero_stage) -> dict:
    """DPOTrainer (fp32) on 32 preference triples, with a reference model of the policy's initial weights, given
    positionally as DPOTrainer takes them (model, ref_model, args)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    tokenizer = tiny_tokenizer()
    # the completions start with a space, so that the prompt's last word stays a word of its own
    pairs = datasets.Dataset.from_dict({"prompt": sentences(32, seed=1), "chosen": sentences(32, seed=2, prefix=" "),
                                        "rejected": sentences(32, seed=3, prefix=" ")})
    options = {} if zero_stage is None else {"zero_stage": zero_stage}
    trainer_class = DPOTrainer if zero_stage is None else with_zero(DPOTrainer)
    trainer = trainer_class(tiny_llama(len(tokenizer)), tiny_llama(len(tokenizer)),
                            DPOConfig(**run_settings(directory, fp32=True)), train_dataset=pairs,
                            processing_class=tokenizer, **options)
    trainer.train()
    return outcome(trainer)


def base_orders() -> dict:
    """What defining each class does: the TypeError's message for the refused orders, the warnings otherwise."""
    import transformers
    from trl import DPOTrainer, SFTTrainer

    from zeroimpl.integrations.trainer import ZeroTrainer

    class OwnOptimizerTrainer(transformers.Trainer):
        def create_optimizer(self, model=None):
            return super().create_optimizer(model)

    def define(name, bases):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                type(name, bases, {})
            except TypeError as error:
                return {"refused": str(error), "warnings": []}
        return {"refused": None, "warnings": [str(w.message) for w in caught if "ZeroTrainer" in str(w.message)]}

    zero_sft = with_zero(SFTTrainer)
    return {"sft_after": define("ZeroSFTTrainer", (SFTTrainer, ZeroTrainer)),
            "sft_first": define("ZeroSFTTrainer", (ZeroTrainer, SFTTrainer)),
            "dpo_first": define("ZeroDPOTrainer", (ZeroTrainer, DPOTrainer)),
            "subclass_of_zero": define("MySFTTrainer", (zero_sft,)),
            "dpo_before_a_zero_subclass": define("Mixed", (DPOTrainer, zero_sft)),
            "own_create_optimizer": define("ZeroOwnOptimizerTrainer", (ZeroTrainer, OwnOptimizerTrainer))}


def plain_trainer_with_sharded_optimizer(directory: str, route: str):
    """transformers.Trainer handed a ShardedOptimizer (``route``: ``optimizers`` or ``optimizer_cls_and_kwargs``)
    instead of ZeroTrainer: the RuntimeError's message, or None if it trained."""
    import transformers

    from zeroimpl import ShardedOptimizer

    model = tiny_llama(len(WORDS) + 3)
    ids = torch.randint(3, len(WORDS) + 3, (16, 8), generator=torch.Generator().manual_seed(0))
    arguments = transformers.TrainingArguments(**run_settings(directory, fp32=True))
    if route == "optimizers":
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        options = {"optimizers": (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))}
    else:
        options = {"optimizer_cls_and_kwargs": (ShardedOptimizer, {"optimizer_class": torch.optim.AdamW, "lr": 1e-3})}
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=[{"input_ids": row, "labels": row}
                                                                               for row in ids], **options)
    try:
        trainer.train()
    except RuntimeError as error:
        return str(error)
    return None


def plain_trainer(directory: str, sharded: bool) -> dict:
    """transformers.Trainer(optimizers=(optimizer, scheduler)) on its own DDP path: torch's AdamW, or (``sharded``)
    ShardedOptimizer(stage=1) in its place, the one-line swap; no checkpoints (save_strategy="no")."""
    import transformers

    from zeroimpl import ShardedOptimizer

    model = tiny_llama(len(WORDS) + 3)
    ids = torch.randint(3, len(WORDS) + 3, (16, 8), generator=torch.Generator().manual_seed(0))
    arguments = transformers.TrainingArguments(**run_settings(directory, fp32=True))
    optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-3) if sharded
                 else torch.optim.AdamW(model.parameters(), lr=1e-3))
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=[{"input_ids": row, "labels": row}
                                                                               for row in ids],
                                   optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)))
    trainer.train()
    return outcome(trainer)


def _all_cases(rank, world_size, directory):
    place = functools.partial(os.path.join, directory)
    return run_cases({
        "sft_ddp": functools.partial(train_sft, place("sft_ddp"), None),
        "sft_stage1": functools.partial(train_sft, place("sft_stage1"), 1),
        "sft_stage2": functools.partial(train_sft, place("sft_stage2"), 2),
        "sft_defaults_ddp": functools.partial(train_sft, place("sft_defaults_ddp"), None, fp32=False),
        "sft_defaults_stage2": functools.partial(train_sft, place("sft_defaults_stage2"), 2, fp32=False),
        "dpo_ddp": functools.partial(train_dpo, place("dpo_ddp"), None),
        "dpo_stage2": functools.partial(train_dpo, place("dpo_stage2"), 2),
        "lora_ddp": functools.partial(train_sft, place("lora_ddp"), None, fp32=False, lora=True),
        "lora_stage2": functools.partial(train_sft, place("lora_stage2"), 2, fp32=False, lora=True, save_steps=2),
        "lora_resumed": functools.partial(train_sft, place("lora_resumed"), 2, fp32=False, lora=True,
                                          resume=place("lora_stage2", "checkpoint-2")),
        "base_orders": base_orders,
        "plain_trainer": functools.partial(plain_trainer, place("plain"), False),
        "plain_trainer_stage1": functools.partial(plain_trainer, place("plain_stage1"), True),
        # last: these leave a DDP-wrapped model whose backward raised
        "trainer_optimizers": functools.partial(plain_trainer_with_sharded_optimizer, place("optimizers"),
                                                "optimizers"),
        "trainer_optimizer_cls": functools.partial(plain_trainer_with_sharded_optimizer, place("optimizer_cls"),
                                                   "optimizer_cls_and_kwargs"),
    })


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(2, _all_cases, str(tmp_path_factory.mktemp("trainer_family")), env=OFFLINE)


# -- the checks -------------------------------------------------------------------------------------
def max_param_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][name] - b["params"][name]).abs().max().item() for name in b["params"])


def relative_distance(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all trainable parameters together."""
    distance = sum(((a["params"][n] - b["params"][n]) ** 2).sum() for n in b["params"]) ** 0.5
    return (distance / sum((p ** 2).sum() for p in b["params"].values()) ** 0.5).item()


def assert_logs_close(zero: dict, reference: dict, rtol: float) -> None:
    assert len(zero["losses"]) == len(reference["losses"]) == STEPS
    assert zero["losses"] == pytest.approx(reference["losses"], rel=rtol)
    assert zero["grad_norms"] == pytest.approx(reference["grad_norms"], rel=rtol)
    assert zero["learning_rates"] == reference["learning_rates"]


def zero_and_reference(ranks, zero_case: str, reference_case: str) -> tuple[dict, dict]:
    """Rank 0's zeroimpl run and reference run, after checking that the zeroimpl run went through ZeroTrainer (no
    DDP), the reference through DDP, and that both ranks of the zeroimpl run hold the same parameters."""
    zero, reference = case_results(ranks, zero_case), case_results(ranks, reference_case)
    assert zero[0]["wrapper"] == "ShardedModule" and reference[0]["wrapper"] == "DistributedDataParallel"
    assert max_param_diff(zero[1], zero[0]) == 0.0
    return zero[0], reference[0]


def test_sft_stage1_is_bitwise_equal_to_sft_trainer_with_ddp(ranks):
    zero, ddp = zero_and_reference(ranks, "sft_stage1", "sft_ddp")
    assert zero["losses"] == ddp["losses"]
    assert max_param_diff(zero, ddp) == 0.0


def test_sft_stage2_matches_sft_trainer_with_ddp(ranks):
    zero, ddp = zero_and_reference(ranks, "sft_stage2", "sft_ddp")
    assert_logs_close(zero, ddp, FP32_RTOL)
    assert max_param_diff(zero, ddp) <= FP32_ATOL
    assert not zero["bf16"] and not zero["gradient_checkpointing"]


def test_sft_config_defaults_bf16_and_checkpointing_match_within_bf16_noise(ranks):
    zero, ddp = zero_and_reference(ranks, "sft_defaults_stage2", "sft_defaults_ddp")
    assert zero["bf16"] and zero["gradient_checkpointing"]  # SFTConfig's defaults in TRL 1.16, kept
    assert ddp["bf16"] and ddp["gradient_checkpointing"]
    assert_logs_close(zero, ddp, 1e-4)
    assert relative_distance(zero, ddp) <= BF16_REL_L2
    fp32 = case_results(ranks, "sft_ddp")[0]
    assert relative_distance(ddp, fp32) > BF16_REL_L2  # autocast really ran in bf16: the bound tells it apart


def test_dpo_matches_dpo_trainer_with_ddp(ranks):
    zero, ddp = zero_and_reference(ranks, "dpo_stage2", "dpo_ddp")
    assert_logs_close(zero, ddp, FP32_RTOL)
    assert max_param_diff(zero, ddp) <= FP32_ATOL
    assert zero["losses"][-1] != zero["losses"][0]  # it trained (the first DPO loss is log 2 whatever the model)


def test_peft_lora_matches_sft_trainer_with_ddp_and_resumes_bitwise(ranks):
    """SFTTrainer's peft_config (LoRA on q_proj and v_proj, SFTConfig's bf16 and checkpointing): only the 8 adapter
    matrices train and are sharded; a resume from the sharded checkpoint of step 2 ends where the run did."""
    zero, ddp = zero_and_reference(ranks, "lora_stage2", "lora_ddp")
    assert len(zero["params"]) == 8 and all("lora_" in name for name in zero["params"])
    assert_logs_close(zero, ddp, 1e-4)
    assert relative_distance(zero, ddp) <= BF16_REL_L2
    resumed = case_results(ranks, "lora_resumed")[0]
    assert resumed["losses"] == zero["losses"]
    assert max_param_diff(resumed, zero) == 0.0


def test_trainer_before_zero_trainer_is_refused_at_class_definition_naming_the_order(ranks):
    orders = case_results(ranks, "base_orders")[0]
    assert orders["sft_after"]["refused"].endswith("Put ZeroTrainer first: class ZeroSFTTrainer(ZeroTrainer, SFTTrainer)")
    assert "zero_stage" in orders["sft_after"]["refused"]
    assert orders["dpo_before_a_zero_subclass"]["refused"].endswith("class Mixed(ZeroSFTTrainer, DPOTrainer)")
    for accepted in ("sft_first", "dpo_first", "subclass_of_zero"):
        assert orders[accepted] == {"refused": None, "warnings": []}, accepted


def test_an_override_zero_trainer_replaces_is_named_when_the_class_is_defined(ranks):
    own = case_results(ranks, "base_orders")[0]["own_create_optimizer"]
    assert own["refused"] is None and len(own["warnings"]) == 1
    assert "OwnOptimizerTrainer.create_optimizer" in own["warnings"][0]


def test_plain_trainer_with_a_stage_1_sharded_optimizer_trains_bitwise_as_its_ddp_path(ranks):
    """Trainer(optimizers=(ShardedOptimizer(stage=1), scheduler)): Trainer moves the model to cpu:0 (followed) and
    wraps it in DDP, which averages the gradients; its accumulation (no_sync) and clipping (torch's, on DDP's full
    gradients) act as with torch's AdamW: bitwise, on every rank."""
    for zero, ddp in zip(case_results(ranks, "plain_trainer_stage1"), case_results(ranks, "plain_trainer")):
        assert zero["wrapper"] == ddp["wrapper"] == "DistributedDataParallel"
        assert zero["losses"] == ddp["losses"] and zero["grad_norms"] == ddp["grad_norms"]
        assert all(torch.equal(zero["params"][name], ddp["params"][name]) for name in ddp["params"])


@pytest.mark.parametrize("route", ["trainer_optimizers", "trainer_optimizer_cls"])
def test_plain_trainer_with_a_sharded_optimizer_raises_on_every_rank_naming_zero_trainer(ranks, route):
    """Trainer copies the model onto ``cpu:0`` (device placement), which the optimizer follows, and wraps it in DDP:
    stage 2 under DDP raises at the first backward, on every rank, naming stage 1 and the route that works."""
    messages = case_results(ranks, route)
    assert all(message is not None for message in messages), messages  # it did not train on any rank
    assert all("zeroimpl.integrations.trainer.ZeroTrainer" in message for message in messages), messages
    assert all("wrapped in DistributedDataParallel" in message and "use stage=1" in message
               for message in messages), messages
