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
