"""The `quantization_config` blocks of the published quantized checkpoints, as their config.json
files spell them (test data, written from the releases, not from moemesh's writer)."""

# DeepSeek-V3/R1 and Qwen3-*-FP8: e4m3 weights, one scale a 128 x 128 tile
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# gpt-oss: the experts in MXFP4, everything else bf16
GPT_OSS_MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
