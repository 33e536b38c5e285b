"""Gemma 4 text MoE against transformers' Gemma4ForCausalLM: tiny random models built locally, fp32
on CPU. Logits, loss and every parameter gradient (renamed to moemesh's tree by the family's own
checkpoint conversion) must agree; checkpoints go both ways.

Tolerance: 1e-5 relative, as for the other families: the same fp32 function in another order
(grouped expert loop vs per-expert masks). transformers initialises every norm, scale,
per_expert_scale and layer_scalar at one; they are randomised here so that a norm applied in the
wrong place, a scale left out or a per-expert scale on the wrong expert shows."""

import json

import pytest
import torch
import transformers

from hf_oracle import assert_same_gradients, batch, compare_with_transformers, gradients, save_round_trip
from moemesh.checkpoint.hf import save_pretrained
from moemesh.checkpoint.load import from_pretrained
from moemesh.errors import ConfigError
from moemesh.models import ModelConfig, build
from moemesh.models.registry import family
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel, reduce_gradients
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp
from numerics import rel_err
from test_parallel_families import GEMMA4

RTOL = 1e-5

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    enable_moe_block=True,
    moe_intermediate_size=12,
    hidden_size_per_layer_input=0,
    sliding_window=4,
    initializer_range=0.1,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
    },
)

CASES = {
    # full layer with a wider head, soft-capped logits, tied embeddings
    "e4_k2_capped": dict(
        num_experts=4,
        top_k_experts=2,
        global_head_dim=16,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
    ),
    # values from the keys on the full layers, with their own (fewer) key/value heads; untied
    "e6_k3_k_eq_v": dict(
        num_experts=6,
        top_k_experts=3,
        global_head_dim=12,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}


def hf_model(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    return randomise_scales(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**TINY, **overrides)))


def randomise_scales(model):
    model = model.float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(
                ("norm.weight", "norm_1.weight", "norm_2.weight", "router.scale", "per_expert_scale", "layer_scalar")
            ):
                tensor.uniform_(0.5, 1.5)
    return model


def as_ours(tensors: dict, config) -> dict:
    return family("gemma4_text").state_from_hf(tensors, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_every_gradient_match_transformers(case, tmp_path):
    theirs = hf_model(CASES[case], seed=len(case))
    ours, out, ref = compare_with_transformers(theirs, tmp_path, len(case) + 1, RTOL)
    input_ids, labels = batch(theirs.config.vocab_size, len(case) + 1)
    # the training path (no logits returned) gives the same loss
    assert rel_err(ours(input_ids, labels=labels, return_logits=False).loss, ref.loss) <= RTOL

    ref.loss.backward()
    out.loss.backward()
    assert_same_gradients(gradients(ours), as_ours(gradients(theirs), ours.config), RTOL)


def test_cases_exercise_the_features():
    """The soft cap bites, and per_expert_scale and layer_scalar change the output."""
    theirs = hf_model(CASES["e4_k2_capped"])
    input_ids, _ = batch(96, 1)
    with torch.no_grad():
        logits = theirs(input_ids=input_ids).logits
        assert logits.abs().max() > 0.5 * theirs.config.final_logit_softcapping
        for name in ["per_expert_scale", "layer_scalar"]:
            saved = {n: t.clone() for n, t in theirs.state_dict().items() if n.endswith(name)}
            for n, t in theirs.state_dict().items():
                if n.endswith(name):
                    t.fill_(1.0)
            assert rel_err(theirs(input_ids=input_ids).logits, logits) > 1e-3, name
            theirs.load_state_dict(saved, strict=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_loads_in_transformers_with_the_same_logits(case, tmp_path):
    theirs = hf_model(CASES[case], seed=7)
    _, _, written = save_round_trip(theirs, tmp_path, RTOL)
    assert written["rope_parameters"] == theirs.config.rope_parameters
    assert written["per_layer_config"] == json.loads((tmp_path / "hf" / "config.json").read_text())["per_layer_config"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input"),
        (dict(num_kv_shared_layers=1), "num_kv_shared_layers"),
        (dict(enable_moe_block=False), "enable_moe_block"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    ],
)
def test_unsupported_features_raise_a_config_error(change, message, tmp_path):
    hf = hf_model(CASES["e4_k2_capped"]).config.to_dict()
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**hf, **change})


def test_images_attending_both_ways_is_read_as_text_only():
    """The published 26B-A4B's use_bidirectional_attention "vision" concerns image tokens; moemesh
    reads the text model, causal, as without it."""
    hf = hf_model(CASES["e4_k2_capped"]).config.to_dict()
    hf.pop("use_bidirectional_attention", None)
    assert ModelConfig.from_hf_dict({**hf, "use_bidirectional_attention": "vision"}) == ModelConfig.from_hf_dict(hf)


# ---- the hub's multimodal checkpoints (Gemma4ForConditionalGeneration) -------------------------
needs_multimodal = pytest.mark.skipif(
    not hasattr(transformers, "Gemma4ForConditionalGeneration"),
    reason="this transformers has no Gemma4ForConditionalGeneration",
)


def hf_multimodal(overrides: dict, seed: int = 0):
    """A tiny Gemma4ForConditionalGeneration: the text model of `overrides` and a one-layer vision
    tower (no audio), tied as the text config says (transformers ties by the outer flag)."""
    torch.manual_seed(seed)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    config = transformers.Gemma4Config(
        text_config=transformers.Gemma4TextConfig(**TINY, **overrides),
        vision_config=vision,
        tie_word_embeddings=overrides.get("tie_word_embeddings", True),
    )
    return randomise_scales(transformers.Gemma4ForConditionalGeneration(config))


@needs_multimodal
@pytest.mark.parametrize("case", sorted(CASES))
def test_multimodal_checkpoint_loads_its_language_model(case, tmp_path, caplog):
    """Logits, loss and every language-model gradient equal transformers' multimodal model on
    text; the vision tower is skipped with one log line; we save the text model alone."""
    theirs = hf_multimodal(CASES[case], seed=len(case))
    vision_tensors = sum(
        name.startswith(("model.vision_tower.", "model.embed_vision.")) for name in theirs.state_dict()
    )
    with caplog.at_level("WARNING", logger="moemesh.checkpoint.hf"):
        ours, out, ref = compare_with_transformers(theirs, tmp_path / "hf", len(case) + 1, RTOL)
    assert [r.getMessage() for r in caplog.records if f"skipped {vision_tensors} tensors" in r.getMessage()]
    assert ours.config.tie_word_embeddings == theirs.config.tie_word_embeddings

    ref.loss.backward()
    out.loss.backward()
    prefix = "model.language_model."
    text_grads = {
        name.replace(prefix, "model."): grad
        for name, grad in gradients(theirs).items()
        if name.startswith(prefix) or name == "lm_head.weight"
    }
    assert_same_gradients(gradients(ours), as_ours(text_grads, ours.config), RTOL)

    save_pretrained(ours, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    input_ids, _ = batch(96, 2)
    with torch.no_grad():
        assert rel_err(reloaded(input_ids=input_ids).logits, theirs(input_ids=input_ids).logits) <= RTOL


@needs_multimodal
def test_multimodal_checkpoint_with_an_unknown_part_or_text_model_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from moemesh.errors import CheckpointError

    hf_multimodal(CASES["e4_k2_capped"]).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "model.multi_modal_projector.weight": torch.zeros(2, 2)}, weights)
    with pytest.raises(
        CheckpointError,
        match="unexpected weight 'model.multi_modal_projector.weight' in a Gemma4ForConditionalGeneration checkpoint",
    ):
        from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["model_type"] = "gemma3_text"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="needs a text_config of model_type 'gemma4_text', got 'gemma3_text'"):
        from_pretrained(tmp_path)


# ---- tensor parallelism of the expert block, with per_expert_scale away from one --------------
WORLD = 2


def built(config):
    """A model whose router scales are random, so that a per_expert_scale applied after the
    block's reduce, on the wrong expert, or with a partial gradient would show."""
    model = build(config, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("per_expert_scale", "gate.scale")):
                param.uniform_(0.5, 1.5, generator=generator)
    return model


def check_per_expert_scale_before_the_one_reduce(rank):
    config = GEMMA4.replace(num_hidden_layers=1, layer_types=["full_attention"])
    mesh = init_mesh(ParallelDims(tp=WORLD))
    reference = built(config)
    model = apply_data_parallel(apply_tp(built(config), mesh), mesh)
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(5))
    layer, theirs = model.model.layers[0], reference.model.layers[0]
    expected = theirs.aggregate(x, theirs.mlp(x)[0])  # both branches and their norms, x the residual
    comm.reset_counts()
    out = layer.aggregate(x, layer.mlp(x)[0])
    assert dict(comm.calls) == {("all_reduce", "forward"): 1}  # the dense MLP's and the experts' sums together
    assert rel_err(out, expected) <= RTOL
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    reduce_gradients(model, mesh)
    for name in ["per_expert_scale", "gate.scale", "gate.proj.weight"]:
        (ours,) = [p.grad for n, p in model.named_parameters() if n.endswith(name)]
        (theirs,) = [p.grad for n, p in reference.named_parameters() if n.endswith(name)]
        assert rel_err(ours, theirs) <= RTOL, name
    return True


def test_per_expert_scale_multiplies_the_partial_before_the_one_reduce(pool):
    assert all(pool.run(check_per_expert_scale_before_the_one_reduce))
