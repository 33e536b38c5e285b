"""Generation on quantized weights kept quantized (`load_for_generation`: an FP8 or MXFP4
checkpoint's weights as QuantizedWeights of each rank's block; `quantize="fp8"` quantizing a
dense checkpoint's projections and expert banks at load), on the tiny published-layout
checkpoints of test_checkpoint_quantized_models.py (CPU, fp32).

The claim is exactness: the engine on the kept weights gives the greedy tokens of the same model
with those weights dequantized to fp32 (and of `--dequantize`'s dense read), several prompts at
once; batching, paging and preemption change no token; under TP=2 and EP=2 (gloo) each rank keeps
its block quantized (TP cuts DeepSeek-V3's tiles: a column offset) and the leader's tokens are one
process's. `--quantize fp8` keeps the codes and scales that quantizing each whole tensor gives,
whatever the layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moemesh.checkpoint.load import hf_state
from moemesh.checkpoint.quantized import quantize_fp8
from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.generate import generate, load_for_generation
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.ops.quantized_weight import FP8_TILE, QuantizedWeight
from test_checkpoint_quantized_models import published  # noqa: F401 - the fixture

WORLD = 2
PROMPTS = [[0, 100, 101, 102], [0, 7], [0, 50, 51, 52, 53, 54, 55, 56, 57], [0, 200, 3]]
TOKENS = 8


def kept_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    return {
        f"{module_name}.{name}": value
        for module_name, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, QuantizedWeight)
    }


def dequantized(model: nn.Module) -> nn.Module:
    """`model` with every QuantizedWeight replaced by its dequantization in fp32, in place."""
    for name, weight in kept_weights(model).items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        delattr(module, name.rsplit(".", 1)[1])
        module.register_parameter(name.rsplit(".", 1)[1], nn.Parameter(weight.to(torch.float32), requires_grad=False))
    return model


def greedy(model, group=None, **engine) -> list[list[int]] | None:
    engine = DecodeEngine(model, max_batch=engine.pop("max_batch", 4), max_len=32, group=group, **engine)
    if not engine.leader:
        engine.follow()
        return None
    results = generate(engine, ByteTokenizer(), PROMPTS, SamplingParams(max_tokens=TOKENS))
    engine.close()
    return [r.token_ids for r in results]


@pytest.mark.parametrize(
    "case, fused",
    [("gpt_oss-mxfp4", False), ("deepseek_v3-fp8", False), ("qwen3_moe-fp8-bf16-scales", False),
     ("deepseek_v3-fp8", True), ("qwen3_moe-fp8-bf16-scales", True)],
)  # fmt: skip
def test_kept_weights_give_the_dequantized_model_s_tokens(published, case, fused, monkeypatch):  # noqa: F811
    """`fused`: every step's experts by grouped GEMMs (as prompts beyond SELECTED_EXPERT_ROWS
    pairs take them), ops/quantized_grouped_mm.py's kernel (a GPU's; here Triton's interpreter)
    multiplying the codes instead of a dequantized bank: the same tokens."""
    if fused:
        from moemesh.models import moe
        from moemesh.ops import quantized_grouped_mm
        from moemesh.ops.backend import HAVE_TRITON, INTERPRETED

        if not HAVE_TRITON or not INTERPRETED:  # these runs are on the CPU
            pytest.skip("the fused kernel on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
        calls, kernel = [], quantized_grouped_mm.quantized_grouped_mm
        monkeypatch.setattr(quantized_grouped_mm, "use_triton", lambda tensor: True)
        monkeypatch.setattr(moe, "SELECTED_EXPERT_ROWS", 0)
        monkeypatch.setattr(
            quantized_grouped_mm, "quantized_grouped_mm", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1]
        )
    source = published[case][0]
    kept, _ = load_for_generation(source, "bytes")
    weights = kept_weights(kept)
    assert weights and kept.kept_quantized.kept
    fmt = "mxfp4" if case.startswith("gpt_oss") else "fp8"
    assert {w.format for w in weights.values()} == {fmt}
    tokens = greedy(kept)
    if fused:
        assert calls  # the prompts' steps multiplied the codes
    assert tokens == greedy(dequantized(kept))
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)
    dense, _ = load_for_generation(source, "bytes", dequantize=True)  # today's dense read: the same weights
    assert not kept_weights(dense) and dense.kept_quantized is None
    for name, weight in kept.state_dict().items():
        assert torch.equal(weight, dense.state_dict()[name]), name


def test_batching_paging_and_preemption_change_no_token(published):  # noqa: F811
    """Each prompt alone, then the four on 10 blocks of 4 tokens (the youngest preempted)."""
    model, _ = load_for_generation(published["qwen3_moe-fp8-bf16-scales"][0], "bytes")
    alone = DecodeEngine(model, max_batch=1, max_len=32)
    expected = [generate(alone, ByteTokenizer(), [p], SamplingParams(max_tokens=TOKENS))[0].token_ids for p in PROMPTS]
    engine = DecodeEngine(model, max_batch=4, max_len=32, block_size=4, num_blocks=11)
    scheduler = Scheduler(engine, ByteTokenizer())
    sequences = [scheduler.submit(p, SamplingParams(max_tokens=TOKENS)) for p in PROMPTS]
    scheduler.run_until_idle()
    assert scheduler.preemptions > 0
    assert [s.token_ids for s in sequences] == expected


def test_quantize_fp8_at_load_quantizes_the_projections_and_banks(published):  # noqa: F811
    """A dense (bf16) checkpoint's attention and expert weights in block FP8, the codes and scales
    of each whole tensor's quantize_fp8; the head, embedding, norms and router stay dense."""
    plain = published["qwen3_moe-fp8-bf16-scales"][0].parent / "qwen3_moe-fp8-bf16-scales-plain"
    model, _ = load_for_generation(plain, "bytes", quantize="fp8")
    weights = kept_weights(model)
    layer = model.config.num_hidden_layers
    assert len(weights) == layer * 6 and model.kept_quantized.kept == {"fp8": layer * 6}
    assert all(n.endswith(("_proj.weight", "gate_up_proj", "down_proj")) for n in weights)
    assert isinstance(model.lm_head.weight, nn.Parameter)
    tensors = hf_state(plain, model.config)
    for name, weight in weights.items():
        whole = torch.empty(tensors[name].shape)
        tensors[name].read_into(whole)
        codes, scales = quantize_fp8(whole)
        assert torch.equal(weight.codes.view(torch.uint8), codes.view(torch.uint8)), name
        assert torch.equal(weight.scales, scales.repeat_interleave(FP8_TILE, -2)[..., : whole.shape[-2], :]), name
    assert greedy(model) == greedy(dequantized(model))
    with pytest.raises(Exception, match="--quantize fp8 keeps weights quantized: not with --dequantize"):
        load_for_generation(plain, "bytes", quantize="fp8", dequantize=True)


def check_layout(rank, source: str, axis: str, quantize: str | None):
    """One process's greedy tokens (on the leader) and, over the 2 ranks laid out on `axis`, the
    leader's; what this rank kept: name -> (format, offset, shape)."""
    from moemesh.parallel.mesh import ParallelDims, init_mesh

    expected = greedy(load_for_generation(source, "bytes", quantize=quantize)[0]) if rank == 0 else None
    mesh = init_mesh(ParallelDims(**{axis: WORLD}))
    model, _ = load_for_generation(source, "bytes", mesh=mesh, quantize=quantize)
    kept = {n: (w.format, w.offset, tuple(w.shape)) for n, w in kept_weights(model).items()}
    tokens = greedy(model, group=mesh.group(axis))
    return expected, tokens, kept


def test_tp2_and_ep2_keep_each_rank_s_block_and_give_one_process_s_tokens(pool, published):  # noqa: F811
    root = published["deepseek_v3-fp8"][0].parent
    for source, quantize in (
        (published["deepseek_v3-fp8"][0], None),
        (published["gpt_oss-mxfp4"][0], None),
        (root / "qwen3_moe-fp8-bf16-scales-plain", "fp8"),  # its attention and experts quantized at load
    ):
        for axis in ("tp",) if source.name.startswith("deepseek") else ("tp", "ep"):  # (EP: no shared experts yet)
            (expected, tokens, kept), (_, _, other) = pool.run(check_layout, str(source), axis, quantize)
            assert tokens == expected, (source.name, axis)
            assert kept and kept.keys() == other.keys(), (source.name, axis)
            if quantize:  # every projection and bank, under every layout (o_proj a row split under TP)
                assert len(kept) == 12, kept.keys()
            if axis == "tp" and source.name == "deepseek_v3-fp8":  # TP=2 cuts tiles: a column offset
                assert any(offset for _, offset, _ in other.values())


def test_the_generate_command_keeps_quantizes_or_dequantizes(published, capsys):  # noqa: F811
    from moemesh.cli import main

    source = published["deepseek_v3-fp8"][0]
    plain = source.parent / "qwen3_moe-fp8-bf16-scales-plain"
    prompt = ["--prompt", "ab", "--max-new-tokens", "3", "--tokenizer", "bytes"]
    assert main(["generate", "--checkpoint", str(source), *prompt]) == 0
    assert "moemesh generate: kept quantized: " in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(source), "--dequantize", *prompt]) == 0
    assert "kept quantized" not in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(plain), "--quantize", "fp8", *prompt]) == 0
    assert "kept quantized: 12 in fp8" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(source), "--batch-invariant", *prompt]) != 0
    assert capsys.readouterr().err.endswith(
        "moemesh generate: error: --batch-invariant does not cover quantized weights yet: add --dequantize\n"
    )
