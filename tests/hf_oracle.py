"""What the tests against tiny random `transformers` models share: a batch with ignored labels,
and the every-gradient comparison."""

import torch

from moemesh.models import from_pretrained
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


def compare_with_transformers(theirs: torch.nn.Module, directory, seed: int, rtol: float, aux: bool = False):
    """Save `theirs`, load it into moemesh, run both on one `batch`: the logits and the loss (and
    with `aux` the load-balancing loss) must agree. Returns (ours, our output, their output)."""
    theirs.save_pretrained(directory)
    ours = from_pretrained(directory)
    input_ids, labels = batch(theirs.config.get_text_config().vocab_size, seed)  # multimodal: its text model's
    ref = theirs(input_ids=input_ids, labels=labels, **({"output_router_logits": True} if aux else {}))
    out = ours(input_ids, labels=labels, output_router_logits=aux)
    assert rel_err(out.logits, ref.logits) <= rtol
    assert abs(out.loss.item() - ref.loss.item()) <= rtol * abs(ref.loss.item())
    if aux:
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= rtol * abs(ref.aux_loss.item())
    return ours, out, ref
