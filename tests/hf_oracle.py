"""What the tests against tiny random `transformers` models share: a batch with ignored labels,
and the every-gradient comparison."""

import torch

from numerics import rel_err


def batch(vocab: int, seed: int):
    """Two sequences of 11 random tokens; the first three labels of the first are ignored."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (2, 11), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100  # ignored positions must not count
    return input_ids, labels


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_gradients(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], rtol: float) -> None:
    """The same parameter names, and every gradient non-zero and equal."""
    assert set(ours) == set(theirs)
    for name, grad in theirs.items():
        assert grad is not None and grad.norm() > 0, name
        assert rel_err(ours[name], grad) <= rtol, name
