"""Adapters between zeroimpl and the wider ecosystem (Hugging Face Trainer, peer ZeRO implementations)."""
