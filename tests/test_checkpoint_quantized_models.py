"""Quantized checkpoints as published, read and converted, on tiny models (fp32, 2 gloo processes).

Tiny transformers models, their weights quantized here by the published formulas (the references
of test_checkpoint_quantized.py) into the published names, shapes and dtypes:
- gpt-oss, MXFP4 experts (`mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16], `_scales`), the
  rest bf16, gpt-oss's quantization_config; experts of width 96, so that TP=2 cuts a 32-group;
- DeepSeek-V3, block FP8 with F32 scales, hidden 160 and kv_a_proj_with_mqa of 144 rows: partial
  tiles everywhere, TP=2 cutting tiles in the middle (kv_b_proj's 192 rows at 96, ...);
- Qwen3-MoE, block FP8 per expert with BF16 scales, every size a multiple of 128;
- DeepSeek-V3 again in llm-compressor's compressed-tensors block FP8 (`weight_scale`, `ignore`).

Each gives transformers' logits on the reference-dequantized weights (the same weights in a plain
directory, loaded by transformers) within 1e-5, and moemesh's weights equal them exactly, in one
process and under TP=2 and EP=2 (each rank reading its part). transformers reading the quantized
directories itself (`dequantize=True`) agrees where its dequantization is right (gpt-oss; Qwen3 at
multiples of 128). `moemesh convert` to a moemesh checkpoint and back with `--quantize` gives the
published bytes back, bit for bit; a bf16 model quantized by moemesh is read by transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moemesh.checkpoint.load import from_pretrained
from moemesh.cli import main
from published_quantization import COMPRESSED_TENSORS, FP8, GPT_OSS_MXFP4
from test_checkpoint_quantized import (
    reference_fp8,
    reference_mxfp4,
    reference_quantize_fp8,
    reference_quantize_mxfp4,
)

WORLD = 2
ATOL = 1e-5
# vocabulary: the byte tokenizer's, for `moemesh generate` and `train.init_from`
COMMON = dict(vocab_size=256, num_hidden_layers=2, initializer_range=0.1, tie_word_embeddings=False)


def tiny_models() -> dict:
    torch.manual_seed(0)
    gpt_oss = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            **COMMON,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        )
    )
    with torch.no_grad():
        for name, param in gpt_oss.named_parameters():
            if "bias" in name or name.endswith("sinks"):
                param.normal_(0.0, 0.3)
    deepseek = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **COMMON,
            hidden_size=160,
            intermediate_size=200,
            moe_intermediate_size=136,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=136,
            kv_lora_rank=136,  # kv_a_proj_with_mqa: 136 + 8 = 144 rows
            qk_rope_head_dim=8,
            qk_nope_head_dim=24,
            v_head_dim=24,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        )
    )
    with torch.no_grad():
        for name, buffer in deepseek.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    qwen3 = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **COMMON,
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            norm_topk_prob=True,
        )
    )
    return {"gpt_oss": gpt_oss, "deepseek_v3": deepseek, "qwen3_moe": qwen3}


def _fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What the published FP8 checkpoints quantize: 2-D projection weights, not the embedding, the
    head or the router."""
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight") and tensor.ndim == 2 and not module.endswith(("embed_tokens", "lm_head", "mlp.gate"))
    )


def publish(plain: dict, kind: str) -> tuple[dict, dict]:
    """A plain checkpoint's tensors -> (the published quantized tensors, the reference-dequantized
    tensors under the plain names); whatever is not quantized in bf16 in both."""
    quantized, dequantized = {}, {}
    for name, tensor in plain.items():
        if kind == "mxfp4" and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            blocks, scales = reference_quantize_mxfp4(tensor.transpose(1, 2))  # stored [E, out, in]
            quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            dequantized[name] = reference_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        elif kind != "mxfp4" and _fp8_quantized(name, tensor):
            weight, scale = reference_quantize_fp8(tensor)
            if kind in ("fp8-bf16", "compressed-tensors"):  # BF16 scales: the elements divided by the scale stored
                scale = scale.bfloat16()
                weight = (tensor.float() / _expanded(scale, tensor.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
            suffix = "weight_scale" if kind == "compressed-tensors" else "weight_scale_inv"
            quantized |= {name: weight, f"{name.removesuffix('weight')}{suffix}": scale}
            dequantized[name] = reference_fp8(weight, scale)
        else:
            quantized[name] = dequantized[name] = tensor.bfloat16()
    return quantized, dequantized


def _expanded(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.float().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


CASES = {  # name -> (family, format)
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4"),
    "deepseek_v3-fp8": ("deepseek_v3", "fp8"),
    "qwen3_moe-fp8-bf16-scales": ("qwen3_moe", "fp8-bf16"),
    "deepseek_v3-compressed-tensors": ("deepseek_v3", "compressed-tensors"),
}
QUANTIZATION = {"mxfp4": GPT_OSS_MXFP4, "fp8": FP8, "fp8-bf16": FP8, "compressed-tensors": COMPRESSED_TENSORS}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Case -> (quantized directory, reference directory, reference logits, input ids)."""
    root = tmp_path_factory.mktemp("quantized")
    models = tiny_models()
    input_ids = torch.randint(0, COMMON["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    for case, (family, kind) in CASES.items():
        plain_dir, quantized_dir, reference_dir = root / f"{case}-plain", root / case, root / f"{case}-reference"
        models[family].save_pretrained(plain_dir)
        plain = load_file(plain_dir / "model.safetensors")
        quantized, dequantized = publish(plain, kind)
        config = json.loads((plain_dir / "config.json").read_text())
        for directory, tensors, extra in (
            (quantized_dir, quantized, {"quantization_config": QUANTIZATION[kind], "dtype": "bfloat16"}),
            (reference_dir, dequantized, {}),
        ):
            directory.mkdir()
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
            (directory / "config.json").write_text(json.dumps({**config, **extra}))
        reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = reference(input_ids=input_ids).logits
        out[case] = quantized_dir, reference_dir, logits, input_ids
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_reads_the_published_weights_exactly(published, case):
    quantized_dir, reference_dir, logits, input_ids = published[case]
    ours = from_pretrained(quantized_dir)
    assert next(ours.parameters()).dtype == torch.float32  # a quantized directory: float32 by default
    reference = from_pretrained(reference_dir, dtype=torch.float32).state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    with torch.no_grad():
        assert torch.allclose(ours(input_ids).logits, logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "case,config", [("gpt_oss-mxfp4", "Mxfp4Config"), ("qwen3_moe-fp8-bf16-scales", "FineGrainedFP8Config")]
)
def test_transformers_reads_them_alike_where_it_dequantizes_right(published, case, config):
    """Bit for bit: their dequantized weights are the reference's."""
    quantized_dir, reference_dir, logits, input_ids = published[case]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        quantized_dir, dtype=torch.float32, quantization_config=getattr(transformers, config)(dequantize=True)
    ).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).state_dict()
    assert theirs.state_dict().keys() == reference.keys()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=input_ids).logits, logits, atol=ATOL, rtol=0)


def check_layout(rank, quantized_dir, logits, input_ids, layout: dict) -> int:
    """This rank's part, read from the quantized directory, gives its part of the logits: under TP
    its vocabulary slice, under EP (a batch split) its rows. Returns the fp8/U8 bytes it read."""
    from moemesh.checkpoint import lazy
    from moemesh.checkpoint.load import load_weights, read_model_config
    from moemesh.models.build import meta_model
    from moemesh.parallel.config import ParallelConfig, StepShape
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.parallelize import materialize, parallelize

    config = read_model_config(quantized_dir)
    mesh = init_mesh(ParallelDims(**layout))
    model = meta_model(config)
    parallelize(model, mesh, ParallelConfig(**layout), StepShape(dtype="float32"))
    materialize(model, "cpu")
    read = []
    box = lazy.Stored._box
    lazy.Stored._box = lambda self, boxes: (read.append(b := box(self, boxes)), b)[1]
    try:
        load_weights(model, quantized_dir, mesh)
    finally:
        lazy.Stored._box = box
    rows = slice(None)
    if layout.get("ep"):
        share = input_ids.shape[0] // layout["ep"]
        rows = slice(rank * share, (rank + 1) * share)
    with torch.no_grad():
        out = model(input_ids[rows]).logits
    expected = logits[rows]
    if layout.get("tp"):
        expected = expected.chunk(layout["tp"], dim=-1)[mesh.rank("tp")]
    assert torch.allclose(out, expected, atol=ATOL, rtol=0), (out - expected).abs().max()
    return sum(b.numel() for b in read if b.dtype in (torch.float8_e4m3fn, torch.uint8))


def test_tp2_and_ep2_read_each_rank_s_part_on_the_tile_grid(pool, published):
    for case in sorted(CASES):
        quantized_dir, _, logits, input_ids = published[case]
        stored = load_file(quantized_dir / "model.safetensors")
        whole = sum(t.numel() for t in stored.values() if t.dtype in (torch.float8_e4m3fn, torch.uint8))
        for layout in (dict(tp=2), dict(ep=2)):
            read = pool.run(check_layout, str(quantized_dir), logits, input_ids, layout)
            # the quantized bytes of the rank's part (and of its tiles' scales), not the whole model's
            assert all(r < whole for r in read), (case, layout, read, whole)


@pytest.mark.parametrize("case", ["gpt_oss-mxfp4", "deepseek_v3-fp8", "qwen3_moe-fp8-bf16-scales"])
def test_convert_to_a_checkpoint_and_back_gives_the_published_bytes(published, case, tmp_path):
    quantized_dir = published[case][0]
    method = "mxfp4" if case.endswith("mxfp4") else "fp8"
    assert main(["convert", str(quantized_dir), str(tmp_path / "checkpoint")]) == 0
    assert (
        main(
            [
                "convert",
                str(tmp_path / "checkpoint"),
                str(tmp_path / "back"),
                "--quantize",
                method,
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert (
        main(["convert", str(quantized_dir), str(tmp_path / "direct"), "--quantize", method, "--dtype", "bfloat16"])
        == 0
    )
    source = load_file(quantized_dir / "model.safetensors")
    for written in ("back", "direct"):
        tensors = {}
        for file in (tmp_path / written).glob("*.safetensors"):
            tensors.update(load_file(file))
        assert tensors.keys() == source.keys()
        for name, tensor in source.items():
            if tensor.dtype == torch.bfloat16 and name.endswith("_scale_inv"):  # Qwen3's BF16 scales come back F32
                assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], tensor.float()), name
                continue
            assert tensors[name].dtype == tensor.dtype and torch.equal(
                tensors[name].view(torch.uint8), tensor.view(torch.uint8)
            ), name
        hf_config = transformers.AutoConfig.from_pretrained(tmp_path / written)
        written_config = json.loads((tmp_path / written / "config.json").read_text())["quantization_config"]
        assert hf_config.quantization_config["quant_method"] == method
        if method == "mxfp4" or case.startswith("deepseek"):
            assert written_config == QUANTIZATION[method]  # as published
        else:  # Qwen3: every module left unquantized listed
            assert written_config.items() >= FP8.items()
            assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= set(
                written_config["modules_to_not_convert"]
            )


@pytest.mark.parametrize(
    "case,config", [("gpt_oss-mxfp4", "Mxfp4Config"), ("qwen3_moe-fp8-bf16-scales", "FineGrainedFP8Config")]
)
def test_a_model_quantized_by_moemesh_is_read_by_transformers(published, case, config, tmp_path):
    _, reference_dir, _, input_ids = published[case]
    method = "mxfp4" if case.endswith("mxfp4") else "fp8"
    assert main(["convert", str(reference_dir), str(tmp_path / "q"), "--quantize", method, "--dtype", "bfloat16"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", dtype=torch.float32, quantization_config=getattr(transformers, config)(dequantize=True)
    ).eval()
    ours = from_pretrained(tmp_path / "q")
    with torch.no_grad():
        assert torch.allclose(ours(input_ids).logits, theirs(input_ids=input_ids).logits, atol=ATOL, rtol=0)


def test_modules_to_not_convert_are_read_as_stored(published, tmp_path):
    """gpt-oss with its second layer's experts left in bf16 (listed in modules_to_not_convert)."""
    quantized_dir, reference_dir, logits, input_ids = published["gpt_oss-mxfp4"]
    tensors = load_file(quantized_dir / "model.safetensors")
    plain = load_file(reference_dir / "model.safetensors")
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        del tensors[f"{key}_blocks"], tensors[f"{key}_scales"]
        tensors[key] = plain[key].bfloat16()  # the dequantized values, stored bf16 (exact)
    (tmp_path / "mixed").mkdir()
    save_file(tensors, str(tmp_path / "mixed" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.1.mlp.experts")
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert torch.allclose(from_pretrained(tmp_path / "mixed")(input_ids).logits, logits, atol=ATOL, rtol=0)


def test_generate_and_train_init_from_take_a_quantized_directory(published, tmp_path, capsys):
    """`moemesh generate --checkpoint` and `train.init_from` on DeepSeek-V3's partial tiles: the
    text and first loss of the reference-dequantized directory."""
    from test_checkpoint_init_from import first_step, run_config
    from tiny_run import write_corpus

    quantized_dir, reference_dir, _, _ = published["deepseek_v3-fp8"]
    texts = []
    for directory in (quantized_dir, reference_dir):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(directory), "--prompt", "def ", "--max-new-tokens", "12"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def \n")
    write_corpus(tmp_path)
    losses = [
        first_step(0, run_config(tmp_path, directory, "one process")) for directory in (quantized_dir, reference_dir)
    ]
    assert losses[0] == losses[1]
