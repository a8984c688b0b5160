"""How each optimizer class is sharded (zeroimpl.optimizer_kinds), in process: elementwise classes step a tensor cut
anywhere as the whole, whole-parameter classes really need the whole parameter, and the precedence of the rules.
References: torch's own optimizers. The kinds in training runs: test_optimizer_kinds_*.py."""

import math

import pytest
import torch

from zeroimpl.optimizer_kinds import ELEMENTWISE_OPTIMIZERS, WHOLE_PARAMETER_OPTIMIZERS, groups_with_classes, sharding_of, step_work


def _stepped(optimizer_class, tensors, grads, kwargs) -> list[torch.Tensor]:
    """``tensors`` (leaf copies) after one step per gradient list of ``grads``."""
    params = [t.clone().requires_grad_(True) for t in tensors]
    optimizer = optimizer_class(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("optimizer_class", sorted(ELEMENTWISE_OPTIMIZERS, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_classes_sharded_flat_step_a_tensor_cut_anywhere_as_the_whole(optimizer_class):
    """Flat sharding cuts parameters at arbitrary element boundaries; that is exact only if torch's class
    updates each element from its own parameter, gradient and state. Three steps of the class on a tensor
    and on the same tensor cut in two pieces agree (fp64, to rounding). Catches: a class that needs whole
    tensors (a norm, factored state) listed as elementwise."""
    torch.manual_seed(0)
    whole = torch.randn(24, dtype=torch.float64)
    grads = [torch.randn(24, dtype=torch.float64) * (1 + step) for step in range(3)]
    kwargs = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
    assert sharding_of(optimizer_class, (), False) == "flat"
    (expected,) = _stepped(optimizer_class, [whole], [[g] for g in grads], kwargs)
    pieces = _stepped(optimizer_class, [whole[:10], whole[10:]], [[g[:10], g[10:]] for g in grads], kwargs)
    torch.testing.assert_close(torch.cat(pieces), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("optimizer_class", sorted(WHOLE_PARAMETER_OPTIMIZERS, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_classes_sharded_by_whole_parameters_really_need_them(optimizer_class):
    """Muon (Newton-Schulz on the matrix) and Adafactor (row and column second moments) step a matrix cut in
    two differently from the whole matrix: flat sharding would change their math. Catches: one of them
    moved to the flat kinds."""
    torch.manual_seed(0)
    whole = torch.randn(4, 6)
    grads = [torch.randn(4, 6) * torch.arange(1, 5).reshape(4, 1) for _ in range(2)]
    assert sharding_of(optimizer_class, (), True) == "whole"  # even where unknown classes are assumed flat
    (expected,) = _stepped(optimizer_class, [whole], [[g] for g in grads], {})
    pieces = _stepped(optimizer_class, [whole[:2], whole[2:]], [[g[:2], g[2:]] for g in grads], {})
    assert (torch.cat(pieces) - expected).abs().max() > 1e-4


def test_sharding_precedence_refused_then_marked_whole_then_known_then_assumed():
    """Catches: per_parameter ignored for a known elementwise class (a user's reason to step AdamW whole);
    a refused class let through because the user marked it; an unknown class assumed flat without the flag."""
    class Unknown(torch.optim.Optimizer):
        pass

    assert sharding_of(torch.optim.AdamW, [torch.optim.AdamW], False) == "whole"
    assert sharding_of(torch.optim.AdamW, [torch.optim.SGD], False) == "flat"
    assert sharding_of(Unknown, [Unknown], False) == "whole"
    assert sharding_of(Unknown, (), True) == "flat"
    with pytest.raises(ValueError, match="cannot tell how to shard Unknown"):
        sharding_of(Unknown, (), False)
    for refused in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(ValueError, match="cannot be sharded"):
            sharding_of(refused, [refused], True)


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (3, 4, 5), (7,)])
def test_step_work_is_newton_schulz_for_muon_and_elements_otherwise(shape):
    """Muon's Newton-Schulz costs m·n·min(m, n) per matrix (its iterations multiply by the smaller side;
    ZERO_NOTES), on the last two dims; any other class costs its elements. Catches: max instead of min, or
    the element count for Muon, which would balance the ranks' step time wrongly."""
    m, n = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    assert step_work(torch.optim.Muon)(shape) == math.prod(shape[:-2]) * m * n * min(m, n)
    assert step_work(torch.optim.AdamW)(shape) == math.prod(shape)


def test_groups_with_classes_fills_defaults_without_overriding_or_mutating():
    """Catches: the optimizer's keyword arguments overriding a group's own value (a group's lr lost), being
    given to a group of another class (AdamW's betas passed to Muon), or the user's dicts being edited."""
    a, b, c = (torch.zeros(2, 2, requires_grad=True) for _ in range(3))
    user = [{"params": [a], "lr": 0.5}, {"params": [b]}, {"params": [c], "optimizer": torch.optim.Muon}]
    groups = groups_with_classes(user, torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.9)})
    assert groups[0] == {"params": [a], "lr": 0.5, "betas": (0.8, 0.9), "optimizer": torch.optim.AdamW}
    assert groups[1] == {"params": [b], "lr": 1e-3, "betas": (0.8, 0.9), "optimizer": torch.optim.AdamW}
    assert groups[2] == {"params": [c], "optimizer": torch.optim.Muon}
    assert user[0] == {"params": [a], "lr": 0.5} and user[1] == {"params": [b]}
    plain = groups_with_classes(iter([a, b]), torch.optim.SGD, {"lr": 0.1})  # a generator, read once
    assert plain == [{"params": [a, b], "optimizer": torch.optim.SGD, "lr": 0.1}]