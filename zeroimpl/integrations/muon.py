"""Which parameters Muon trains in the recipes: the hidden matrices of a model (used by ZeroTrainer's
``zero_muon`` and by the comparison adapters' ``"muon"`` optimizer)."""

from __future__ import annotations

import torch


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights Muon recipes train with Muon: the 2-D weights of the linear layers (``torch.nn.Linear`` and
    transformers' ``Conv1D``, GPT-2's), not the embeddings or the output head (a Hugging Face model's
    ``get_output_embeddings()``, tied or not), in module order, each once."""
    heads = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = heads.weight if heads is not None else None
    found, seen = [], set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module).__name__ in ("Linear", "Conv1D") and isinstance(weight, torch.nn.Parameter)
                and weight.ndim == 2 and weight is not head and id(weight) not in seen):
            seen.add(id(weight))
            found.append(weight)
    return found


def split_hidden_matrices(model: torch.nn.Module, groups: list[dict]) -> tuple[list, list[dict]]:
    """(the trainable hidden matrices, ``groups`` without them): how Muon recipes split a model's param
    groups between Muon and the optimizer of everything else."""
    matrices = [p for p in hidden_matrices(model) if p.requires_grad]
    chosen = {id(p) for p in matrices}
    return matrices, [{**g, "params": [p for p in g["params"] if id(p) not in chosen]} for g in groups]
