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
# llm-compressor's block FP8 (compressed-tensors), the router and head left as stored
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "block",
                "block_structure": [128, 128],
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "group",
                "group_size": 128,
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
}
