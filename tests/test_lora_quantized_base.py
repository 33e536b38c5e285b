"""LoRA on a quantized base kept quantized (`lora.keep_quantized`, checkpoint/quantized_base.py,
ops/quantized_weight.py), on the tiny published-layout checkpoints of
test_checkpoint_quantized_models.py (gpt-oss MXFP4, DeepSeek-V3 block FP8 with partial tiles,
Qwen3-MoE FP8 with BF16 scales, compressed-tensors).

The claim is exactness: the products dequantize the kept codes to the values the dense read gives,
so two steps of a LoRA run on the kept base give the same losses and the same adapters, bit for bit
(CPU, fp32), as on the base read dense — in one process and under TP=2 and EP=2 (gloo), where each
rank keeps its block's codes and scales. The kept weights are QuantizedWeight objects of the
published bytes' size, and the dequantization kernel (Triton's interpreter) equals its reference
on every code and on partial tiles.
"""

from __future__ import annotations

import dataclasses
import io
import os

import pytest
import torch

from moemesh.config import config_from_dict
from moemesh.ops import grouped_mm
from moemesh.ops.quantized_weight import QuantizedWeight, dequantize_reference, dequantize_triton
from moemesh.train.trainer import Trainer
from numerics import rel_err
from test_checkpoint_quantized_models import CASES, published  # noqa: F401 - the fixture
from tiny_run import tiny_raw, write_corpus

WORLD = 2
TRAIN = {"steps": 2, "global_batch": 8, "micro_batch": 4, "seq_len": 16, "eval_every": 0, "save_every": 0}


def lora_run(rank, directory: str, source: str, keep: bool, layout: dict, recompute: str = "none") -> dict:
    """Two LoRA steps (every projection and every expert adapted) from `source`: losses, adapters, and
    what the base kept quantized."""
    from moemesh.checkpoint.load import init_source

    run_dir = os.path.join(
        directory, f"run-{os.path.basename(source)}-{keep}-{recompute}-{'-'.join(map(str, layout.items()))}"
    )
    raw = tiny_raw(run_dir, os.path.join(directory, "corpus.txt"), **TRAIN, activation_checkpointing=recompute)
    del raw["model"]
    raw["train"]["init_from"] = source
    raw["parallel"] = layout
    raw["lora"] = {"rank": 4, "alpha": 8.0, "targets": ["*_proj*"], "experts": True, "keep_quantized": keep}
    lines = io.StringIO()
    trainer = Trainer(config_from_dict(raw, init_source=init_source), lines)
    trainer._describe()
    losses = [trainer.train_step()["loss"] for _ in range(TRAIN["steps"])]
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    kept = {
        name: (weight.format, weight.nbytes, weight.numel())
        for module_name, module in trainer.model.named_modules()
        for name, weight in ((f"{module_name}.{k}", v) for k, v in vars(module).items())
        if isinstance(weight, QuantizedWeight)
    }
    return {"losses": losses, "adapters": adapters, "kept": kept, "lines": lines.getvalue()}


def _same(kept: dict, dense: dict, case: str) -> None:
    assert kept["losses"] == dense["losses"], (case, kept["losses"], dense["losses"])
    assert kept["adapters"].keys() == dense["adapters"].keys()
    for name, value in kept["adapters"].items():
        assert torch.equal(value, dense["adapters"][name]), (case, name)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-quantized")
    write_corpus(directory)
    return directory


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_on_the_kept_base_is_lora_on_the_dense_base_bit_for_bit(published, corpus, case, monkeypatch):  # noqa: F811
    source = str(published[case][0])
    kept = lora_run(0, str(corpus), source, True, {})
    dense = lora_run(0, str(corpus), source, False, {})
    _same(kept, dense, case)
    if case.startswith("gpt_oss"):  # a bank too big to dequantize whole: an expert at a time
        monkeypatch.setattr(grouped_mm, "DENSE_BANK_BYTES", 1)
        runs, by_runs = [], grouped_mm._product_by_runs
        monkeypatch.setattr(grouped_mm, "_product_by_runs", lambda *a, **k: (runs.append(1), by_runs(*a, **k))[1])
        _same(lora_run(0, str(corpus), source, True, {}), dense, case)
        assert runs  # forward and backward's products went expert by expert
    assert not dense["kept"] and kept["kept"], case
    fmt = "mxfp4" if case.startswith("gpt_oss") else "fp8"
    assert {f for f, _, _ in kept["kept"].values()} == {fmt}
    for name, (_, nbytes, numel) in kept["kept"].items():  # codes and per-row scales: under a byte an element
        assert nbytes < numel * (0.6 if fmt == "mxfp4" else 1.2), (name, nbytes, numel)
    if fmt == "mxfp4":  # gpt-oss: exactly the experts
        assert all(".mlp.experts." in name for name in kept["kept"]) and len(kept["kept"]) == 4
    assert "base    kept quantized:" in kept["lines"], kept["lines"]


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("fused", [False, True])
def test_checkpointed_layers_dequantize_a_bank_once_for_recomputation_and_backward(
    published,  # noqa: F811
    corpus,
    recompute,
    fused,
    monkeypatch,
):
    """Under activation checkpointing the recomputation's dequantized bank is saved for backward
    (grouped_mm.shared_bank), and so are the projections' dense weights: each expert bank and
    each projection is dequantized twice a micro-batch (forward, and recomputation + backward),
    not three times; the run stays the dense base's bit for bit. With the fused FP8 grouped GEMM
    (a GPU's, here Triton's interpreter: `fused`) the forward dequantizes no bank: once a
    micro-batch, and the run the dense base's to fp32's accumulation order: the losses to 1e-5
    relative; the adapters, norm-wise, to 1e-3: AdamW's first steps move each element by about
    the learning rate whatever its gradient's size, so a near-zero gradient's sign, which a
    product's last bits can flip, moves an element of B by twice that (the kernel alone:
    tests/test_ops_quantized_grouped_mm.py, 1e-6)."""
    if fused:
        from moemesh.ops import quantized_grouped_mm
        from moemesh.ops.backend import HAVE_TRITON, INTERPRETED

        if not HAVE_TRITON or not INTERPRETED:  # these runs are on the CPU
            pytest.skip("the fused kernel on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
        monkeypatch.setattr(quantized_grouped_mm, "use_triton", lambda tensor: True)
    source = str(published["qwen3_moe-fp8-bf16-scales"][0])
    dense = lora_run(0, str(corpus), source, False, {}, recompute)
    banks, dequantize = [], QuantizedWeight.to
    monkeypatch.setattr(
        QuantizedWeight, "to", lambda self, dtype: (banks.append(self.ndim), dequantize(self, dtype))[1]
    )
    kept = lora_run(0, str(corpus), source, True, {}, recompute)
    if fused:
        assert kept["losses"] == pytest.approx(dense["losses"], rel=1e-5)
        for name, value in kept["adapters"].items():
            assert rel_err(value, dense["adapters"][name]) <= 1e-3, name
    else:
        _same(kept, dense, recompute)
    layers, steps, micro_batches = 2, TRAIN["steps"], TRAIN["global_batch"] // TRAIN["micro_batch"]
    expert_banks, projections = 2 * layers, 4 * layers  # gate_up and down; q, k, v, o
    forwards = steps * micro_batches
    assert banks.count(3) == (1 if fused else 2) * expert_banks * forwards, banks.count(3)
    assert banks.count(2) == 2 * projections * forwards, banks.count(2)


def test_under_tp2_and_ep2_each_rank_keeps_its_block_quantized(pool, published, corpus):  # noqa: F811
    for case in ("gpt_oss-mxfp4", "deepseek_v3-fp8"):
        source = str(published[case][0])
        for layout in (dict(tp=2), dict(ep=2)):
            kept = pool.run(lora_run, str(corpus), source, True, layout)
            dense = pool.run(lora_run, str(corpus), source, False, layout)
            for rank in range(WORLD):
                _same(kept[rank], dense[rank], (case, layout, rank))
                assert kept[rank]["kept"], (case, layout)
            if case.startswith("deepseek"):  # TP=2 cuts tiles: the rows' scales and the column offset
                assert kept[0]["kept"].keys() == kept[1]["kept"].keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantization_kernel_is_its_reference(dtype, triton_kernels):
    """Every e4m3 code (NaN included) and every E2M1 code with every E8M0 scale, and partial tiles
    with a column offset, under Triton's interpreter."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(torch.float8_e4m3fn)  # [3, 256]
    scales = torch.rand(3, 3, generator=generator) * 4
    for weight in (
        QuantizedWeight("fp8", codes, scales[:, :2]),
        QuantizedWeight("fp8", codes[:, :200].contiguous(), scales[:, :2]),  # a partial last tile
        QuantizedWeight("fp8", codes[:, 50:250].contiguous(), scales, offset=78),  # 78 + 200 columns: 3 tiles
        QuantizedWeight(
            "mxfp4",
            torch.randint(0, 256, (2, 256, 4, 16), dtype=torch.uint8, generator=generator),
            torch.arange(256, dtype=torch.uint8).repeat(2, 4, 1).transpose(1, 2).contiguous(),
        ),
    ):
        expected, out = dequantize_reference(weight, dtype), dequantize_triton(weight, dtype)
        assert torch.equal(expected.isnan(), out.isnan())
        # bf16 subnormals (E8M0 bytes 0-1 times small codes) aside: the interpreter's conversion
        # loses their last bit, which a GPU's does not
        normal = (expected.abs() >= torch.finfo(dtype).tiny) | (expected == 0) | expected.isnan()
        assert normal.float().mean() > 0.9
        assert torch.equal(expected.nan_to_num(0.0)[normal], out.nan_to_num(0.0)[normal]), weight


def test_estimate_counts_a_kept_base_at_its_bytes():
    """`moemesh estimate` on gpt-oss-120b's and Qwen3-30B-A3B-FP8's configs: the base's parameter
    bytes are the formats' (MXFP4 experts at 0.53 B a weight, FP8 projections at 1.03 B, the rest
    bf16), counted independently here from the model's parameters."""
    from moemesh.config import load_config
    from moemesh.models.build import meta_model
    from moemesh.parallel.pipeline.memory import run_costs

    for name, quantized, per_weight in (
        ("gpt_oss_120b", "mxfp4", 0.5 + 1 / 32),
        ("qwen3_30b_a3b_fp8", "fp8", 1 + 4 / 128),
    ):
        config = load_config(f"configs/{name}.toml", launched=False)
        assert config.step_shape.quantized_base == quantized
        expected = 0.0
        for param_name, param in meta_model(config.model).named_parameters():
            bank = ".mlp.experts." in param_name and not param_name.endswith("_bias")
            projection = param.ndim == 2 and "_proj" in param_name and not param_name.startswith("lm_head")
            expected += param.numel() * (per_weight if bank or (quantized == "fp8" and projection) else 2)
        counted = sum(c.param_bytes for c in run_costs(config.model, config.parallel, config.step_shape))
        assert counted == pytest.approx(expected, rel=1e-9), name
        dense = dataclasses.replace(config.step_shape, quantized_base="")
        assert counted < 0.6 * sum(c.param_bytes for c in run_costs(config.model, config.parallel, dense))
