"""bf16 on a CUDA GPU against the fp32 evaluation of the same weights, with transformers' own bf16
error on the same model as the yardstick. Runs where a GPU is present (`pytest tests/test_gpu_bf16.py`
on a GPU machine); on CPU-only machines it is skipped.

Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation); through
four layers and a softmax router a relative logit error of a few 1e-3 is expected, and a token
whose top-k choice flips under rounding adds more. We require ≤ 2e-2 and no worse than 1.25× the
error transformers itself makes in bf16 on the same model (+1e-3)."""

import pytest
import torch
import transformers

from moemesh.checkpoint.load import from_pretrained
from numerics import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_bf16_logits_track_fp32(model_type, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    common = dict(
        vocab_size=1024,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts_per_tok=4,
    )
    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=16, moe_intermediate_size=256, norm_topk_prob=True)
        theirs = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=16, intermediate_size=256)
        theirs = transformers.MixtralForCausalLM(config)
    theirs.save_pretrained(tmp_path)
    input_ids = torch.randint(0, 1024, (2, 256), device="cuda")
    with torch.no_grad():
        ours = from_pretrained(tmp_path, dtype=torch.float32, device="cuda").eval()
        reference = ours(input_ids).logits
        ours_bf16 = ours.to(torch.bfloat16)(input_ids).logits
        theirs = theirs.to("cuda", torch.bfloat16).eval()
        theirs_bf16 = theirs(input_ids=input_ids).logits
    ours_err, theirs_err = rel_err(ours_bf16, reference), rel_err(theirs_bf16, reference)
    print(f"{model_type}: bf16 logits rel. error vs fp32: moemesh {ours_err:.2e}, transformers {theirs_err:.2e}")
    assert torch.isfinite(ours_bf16).all()
    assert ours_err <= 2e-2
    assert ours_err <= 1.25 * theirs_err + 1e-3


@pytest.mark.parametrize(
    "tokens, experts, k",
    [(1, 128, 8), (64, 128, 8), (128, 128, 8), (512, 8, 2)],
)  # Qwen3-30B-A3B's experts at 1, 64 and 128 tokens; and 128 pairs an expert (the grouped
# launch's 128-row blocks over 64-row tiles), as Mixtral's 8 experts at 512 tokens
def test_bf16_selected_experts_equal_the_grouped_path_bit_for_bit(monkeypatch, tokens, experts, k):
    """Batch-invariant mode's decode path (ops/invariant.py's `selected_experts`: no dispatch)
    against its grouped path (`experts` over `permute`'s dispatch) on the Qwen3-30B-A3B expert
    shapes (H 2048, I 768) in bf16, compiled: every (token, slot) row the same bits; within
    bf16's rounding of an fp32 evaluation (relative 1e-2)."""
    from moemesh.ops import invariant, permute
    from moemesh.ops.swiglu import swiglu

    monkeypatch.setenv("MOEMESH_KERNELS", "triton")
    torch.manual_seed(tokens)
    hidden, inner = 2048, 768
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    gate_up = (torch.randn(experts, 2 * inner, hidden, device="cuda") * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inner, device="cuda") * inner**-0.5).bfloat16()
    ids = torch.randn(tokens, experts, device="cuda").topk(k, dim=-1).indices  # fresh routing, as a router's
    with torch.no_grad():
        selected = invariant.selected_experts(x, ids, gate_up, down, swiglu)
        dispatched = permute(x, ids, experts)
        grouped = invariant.experts(dispatched.grouped, dispatched.offsets.diff(), gate_up, down, swiglu)
    assert selected.shape == (tokens * k, hidden) and selected.dtype == torch.bfloat16
    assert torch.equal(selected, grouped[dispatched.position.flatten()])
    flat, rows = ids.flatten(), x.float().repeat_interleave(k, 0)
    expected = torch.empty(tokens * k, hidden, device="cuda")
    for e in flat.unique().tolist():
        chosen = flat == e
        expected[chosen] = swiglu(rows[chosen] @ gate_up[e].float().T) @ down[e].float().T
    assert rel_err(selected, expected) <= 1e-2
