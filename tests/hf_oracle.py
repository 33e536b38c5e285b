"""What the tests against tiny random `transformers` models share: a batch with ignored labels,
the every-gradient comparison, and the checkpoint round trips."""

import json
from pathlib import Path

import torch
import transformers

from moemesh.checkpoint.hf import save_pretrained
from moemesh.checkpoint.load import from_pretrained
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


def save_round_trip(theirs: torch.nn.Module, directory: Path, rtol: float):
    """`theirs` saved by transformers, loaded into moemesh and saved again by moemesh: transformers
    loads that back as the same class with every tensor as it wrote it and the same logits, and
    moemesh loads it back tensor for tensor. Returns (ours, theirs reloaded, moemesh's config.json)."""
    theirs.save_pretrained(directory / "hf")
    ours = from_pretrained(directory / "hf")
    save_pretrained(ours, directory / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "ours", dtype=torch.float32).eval()
    assert type(reloaded) is type(theirs)
    for name, tensor in theirs.state_dict().items():  # the exact names and layout transformers writes
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    input_ids, _ = batch(theirs.config.vocab_size, seed=8)
    with torch.no_grad():
        assert rel_err(reloaded(input_ids=input_ids).logits, ours(input_ids).logits) <= rtol
    again = from_pretrained(directory / "ours")
    assert again.config.to_hf_dict() == ours.config.to_hf_dict()  # the same config.json again
    for (name, p), (_, q) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), name
    return ours, reloaded, json.loads((directory / "ours" / "config.json").read_text())
