"""Hugging Face models built offline from config objects, and the synthetic data every implementation sees.

``build_model(family, size)`` gives the same initial weights in every process (seeded), so that runs of
different implementations start from identical parameters. Sizes (approximate trainable parameters with
the vocabulary below): ``tiny`` ~30K (tests), ``small`` ~1.1M (a quick comparison: about a minute on two
CPU cores), ``base`` ~27-34M (the default comparison), ``large`` ~110M for GPT-2, ``1b`` ~1B (for GPUs).

``family`` may instead be a local model directory (``config.json``, and weights if saved with
``save_pretrained``): the model is loaded from it (its own weights, or seeded initial ones from the config
alone) with the head its config names (causal LM, masked LM or sequence-to-sequence LM), in eval mode (no
dropout, as the built-in families); ``size`` is then ignored, and batches use the config's vocabulary and ``DIRECTORY_SEQUENCE_LENGTH`` tokens (fewer if the
model's positions are fewer).
"""

from __future__ import annotations

import functools
import os

import torch

FAMILIES = ("gpt2", "llama", "bert", "t5")
SIZES = {  # (hidden, layers, heads, vocabulary, sequence length)
    "tiny": (32, 2, 2, 128, 16),
    "small": (128, 4, 4, 2048, 64),
    "base": (512, 8, 8, 8192, 128),
    "large": (768, 12, 12, 32000, 256),
    "55m": (768, 6, 12, 16384, 128),  # GPT-2 55M: what zeroimpl adds over the compute (benchmarks/overhead.py)
    # GPT-2 36.8M whose bytes are large against its compute (a tied 65536-word embedding, one layer, 16 tokens):
    # the link-bound workload of benchmarks/network.py
    "link": (512, 1, 8, 65536, 16),
    "350m": (1024, 24, 16, 32000, 512),  # GPT-2 0.34B: the GPU benchmark's comparison (benchmarks/gpu.py)
    "1b": (2048, 20, 16, 32000, 512),  # GPT-2 1.07B, LLaMA 0.89B: the GPU benchmark's (benchmarks/gpu.py)
}


DIRECTORY_SEQUENCE_LENGTH = 128


def is_directory_model(family: str) -> bool:
    """Whether ``family`` names a local model directory rather than one of ``FAMILIES``."""
    return family not in FAMILIES and os.path.isfile(os.path.join(family, "config.json"))


def _directory_model(path: str) -> torch.nn.Module:
    """The model saved in ``path``: the class its config names (``architectures``), else the first of causal,
    sequence-to-sequence and masked language model that exists for its type; its weights if saved, else
    seeded initial ones. In eval mode (dropout off), so that every implementation computes the same
    function whatever random numbers it draws; gradients flow as in train mode."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    has_weights = any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path))
    named = [getattr(transformers, name) for name in config.architectures or () if hasattr(transformers, name)]
    if named:
        model_class = named[0]
        return (model_class.from_pretrained(path) if has_weights else model_class(config)).eval()
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM,
                 transformers.AutoModelForMaskedLM):
        try:
            return (auto.from_pretrained(path) if has_weights else auto.from_config(config)).eval()
        except ValueError:  # this head does not exist for the config's model type
            continue
    raise ValueError(f"{path}: model type {config.model_type!r} has no causal, sequence-to-sequence or masked "
                     "language-model head in transformers; the comparison trains language models only")


def build_model(family: str, size: str = "tiny", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model (seed 0, no dropout in the built-in families) whose ``forward(**batch)`` returns ``.loss``."""
    import transformers

    if is_directory_model(family):
        torch.manual_seed(0)
        return _directory_model(family).to(dtype)
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(f"unknown model {family!r} / size {size!r}: families {FAMILIES} or a local model "
                         f"directory (with config.json), sizes {tuple(SIZES)}")
    hidden, layers, heads, vocab, seq_len = SIZES[size]
    torch.manual_seed(0)
    if family == "gpt2":  # tied input and output embeddings
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=hidden, n_layer=layers,
                                         n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq_len,
                                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    elif family == "bert":
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         max_position_embeddings=seq_len, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, pad_token_id=0)
        model = transformers.BertForMaskedLM(config)
    else:
        config = transformers.T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden,
                                       num_layers=layers // 2 or 1, num_heads=heads, dropout_rate=0.0,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config)
    return model.to(dtype)


@functools.lru_cache(maxsize=None)
def vocabulary_and_length(family: str, size: str) -> tuple[int, int]:
    """The batches' vocabulary and sequence length for ``family`` (or a model directory) and ``size``."""
    if is_directory_model(family):
        import transformers

        config = transformers.AutoConfig.from_pretrained(family)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return config.vocab_size, min(DIRECTORY_SEQUENCE_LENGTH, positions or DIRECTORY_SEQUENCE_LENGTH)
    _, _, _, vocab, seq_len = SIZES[size]
    return vocab, seq_len


def batch(family: str, size: str, rank: int, step: int, micro: int, batch_size: int = 4) -> dict:
    """Micro-batch ``micro`` of optimizer step ``step`` on ``rank``: deterministic, different per rank.

    Token 0 is reserved (padding / start), so ids are drawn from ``[2, vocab)``. T5 gets the same ids as
    encoder input and as labels (a copy task); the others are language-modelled on the ids themselves.
    """
    vocab, seq_len = vocabulary_and_length(family, size)
    generator = torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)
    ids = torch.randint(2, vocab, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The usual Hugging Face split: decayed matrices, undecayed biases and norms (trainable only)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
