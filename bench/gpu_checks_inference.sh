#!/usr/bin/env bash
# The GPU checks of the meta-device build, checkpoint loading and the inference engine on one GPU,
# in parts that fit a device call each (10 minutes). Logs go to $LOGS; the tables are printed.
#   bash bench/gpu_checks_inference.sh setup    the GPU tests of the engine and kernels; building
#       from the seed (6 and 48 layers) and the Trainer's setup; writing the largest 48-layer cut
#       the disk holds and loading it for generation (bench/load.py)
#   bash bench/gpu_checks_inference.sh decode6  decoding, 6-layer shape, moemesh beside transformers
#   bash bench/gpu_checks_inference.sh decode48 decoding, the full 48-layer shape, both sides
#   bash bench/gpu_checks_inference.sh fused    the GPU tests of the decoding kernels (compiled, bf16
#       included); decoding of the 48-layer shape beside transformers, as shipped and with cuBLAS
#       projections; the 6-layer shape at batch 1; the kernels of a 6-layer batch-1 step
#   bash bench/gpu_checks_inference.sh fused2   the same tests, shown; the 48-layer shape as shipped,
#       transformers at batch 1 beside it; the kernels of a 6-layer batch-1 step
#   bash bench/gpu_checks_inference.sh tests    the GPU tests of the decoding kernels and generation
#       (compiled, bf16 included), a process per file
#   bash bench/gpu_checks_inference.sh curve    the 48-layer shape at batch 1, 4, 16, 64, as shipped
#       and with the experts read per expert at every batch, transformers at batch 1 and 64 beside
#       it; the 6-layer shape at batch 1 and 64, transformers at batch 1
#   bash bench/gpu_checks_inference.sh profile  the kernels of a 6-layer decode step at batch 1 and 64
#   bash bench/gpu_checks_inference.sh serve    the 6-layer shape served by `moemesh serve`'s
#       engine under 1, 16 and 64 streaming openai clients, beside the engine alone (serve_load.py)
#   bash bench/gpu_checks_inference.sh serve48  the same, 48-layer shape, 1 to 256 clients, with
#       the capacity of serve's default settings (a 32k-token prompt)
#   bash bench/gpu_checks_inference.sh paged    the GPU tests of the paged cache, kernels and
#       scheduler (compiled, bf16 included); the offline workload, prefill and prefix tables on
#       the 6-layer shape beside transformers (bench/serve_offline.py); its agreement in fp32
#   bash bench/gpu_checks_inference.sh offline48  the offline workload (256 prompts of 128-1024
#       tokens, 256 new each) and the prefill and prefix tables, 48-layer shape, moemesh alone
#   bash bench/gpu_checks_inference.sh peer48   the same workload through transformers' generate_batch
#   bash bench/gpu_checks_inference.sh graphs   the GPU tests of the paged engine (packed steps as
#       CUDA graphs), a process per file; the prefill, prefix and profile tables of the 48-layer
#       shape with packed steps eager (--packed-graph-tokens 0) and as graphs (the default)
# Packages the image lacks (fastapi, uvicorn and theirs) travel as wheels in .whl (device README).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0
LOGS=${LOGS:-/tmp/moemesh_gpu_checks}
mkdir -p "$LOGS"
quiet() { grep -v "^W1\|UserWarning\|_warn_once\|warnings.warn"; }
case "${1:-setup}" in
setup)
    timeout 200 python3 -m pytest -q tests/test_gpu_bf16.py tests/test_ops_expert_gemv.py \
        tests/test_inference_generate.py tests/test_inference_sampling.py tests/test_models_decoding.py \
        > "$LOGS/gpu_tests.txt" 2>&1
    echo "== GPU tests"; grep -E "passed|failed|Error" "$LOGS/gpu_tests.txt" | tail -5
    timeout 360 python3 bench/load.py 2>&1 | quiet | tail -16
    ;;
paged)
    timeout 300 python3 -m pytest -q tests/test_ops_decode_kernels.py tests/test_models_decoding.py \
        tests/test_inference_paging.py tests/test_inference_generate.py > "$LOGS/paged_tests.txt" 2>&1
    echo "== GPU tests"; grep -E "passed|failed|Error" "$LOGS/paged_tests.txt" | tail -5
    timeout 200 python3 bench/serve_offline.py --layers 6 --prompts 64 --new-tokens 128 2>&1 | quiet | tail -30
    timeout 100 python3 bench/serve_offline.py --layers 6 --prompts 64 --new-tokens 128 --dtype float32 --check 16 \
        --prefill-len 0 --prefix-len 0 --no-transformers 2>&1 | quiet | tail -6
    ;;
graphs)
    for file in inference_paging ops_decode_kernels inference_generate models_decoding; do
        timeout 300 python3 -m pytest -q tests/test_$file.py > "$LOGS/graphs_tests_$file.txt" 2>&1 &
    done
    wait
    echo "== GPU tests"; for f in "$LOGS"/graphs_tests_*.txt; do echo "$f: $(tail -1 "$f")"; done
    for tokens in ${TOKENS:-0 2048}; do
        echo "== --packed-graph-tokens $tokens"
        timeout 170 python3 bench/serve_offline.py --layers 48 --no-offline --no-transformers --profile-step 64 \
            --packed-graph-tokens $tokens 2>&1 | quiet | grep -v "^$" | head -${ROWS:-34}
    done
    ;;
offline48)
    timeout 580 python3 bench/serve_offline.py --layers 48 --prompts 256 --new-tokens 256 --no-transformers \
        2>&1 | quiet | tail -30
    ;;
peer48)
    timeout 580 python3 bench/serve_offline.py --layers 48 --prompts 256 --new-tokens 256 --no-moemesh \
        2>&1 | quiet | tail -12
    ;;
decode6)
    timeout 560 python3 bench/decode.py --layers 6 2>&1 | quiet | tail -20
    ;;
fused)
    timeout 170 python3 -m pytest -q -x tests/test_ops_decode_kernels.py tests/test_ops_expert_gemv.py \
        tests/test_models_decoding.py tests/test_gpu_bf16.py > "$LOGS/gpu_tests.txt" 2>&1
    echo "== GPU tests"; grep -E "passed|failed|Error|error" "$LOGS/gpu_tests.txt" | tail -8
    timeout 330 python3 bench/decode.py --layers 48 --variants 2 2>&1 | quiet | tail -14
    timeout 45 python3 bench/decode.py --layers 6 --batches 1,64 --variants 2 --no-transformers 2>&1 | quiet | tail -7
    timeout 45 python3 bench/decode.py --layers 6 --profile-steps 32 2>&1 | quiet | grep "|" | head -24
    ;;
fused2)
    timeout 280 python3 -m pytest -q -x tests/test_ops_decode_kernels.py tests/test_ops_expert_gemv.py \
        tests/test_models_decoding.py tests/test_inference_generate.py 2>&1 | tail -6
    timeout 200 python3 bench/decode.py --layers 48 --variants 1 --transformers-batches 1 2>&1 | quiet | tail -8
    timeout 45 python3 bench/decode.py --layers 6 --profile-steps 32 2>&1 | quiet | grep "|" | head -16
    ;;
tests)  # one process a file: compiling and tuning the kernels for each test's shapes is the slow part
    for file in ops_expert_gemv ops_decode_kernels models_decoding inference_generate; do
        timeout 290 python3 -m pytest -q tests/test_$file.py > "$LOGS/gpu_tests_$file.txt" 2>&1 &
    done
    wait
    echo "== GPU tests"; for f in "$LOGS"/gpu_tests_*.txt; do echo "$f: $(tail -1 "$f")"; done
    ;;
curve)
    timeout 330 python3 bench/decode.py --layers 48 --variants 2 --transformers-batches 1,64 2>&1 | quiet | tail -12
    timeout 60 python3 bench/decode.py --layers 6 --batches 1,64 --variants 1 --transformers-batches 1 2>&1 | quiet | tail -5
    ;;
profile)
    for batch in 1 64; do
        timeout 60 python3 bench/decode.py --layers 6 --profile-steps 16 --profile-batch $batch 2>&1 | quiet | grep "|" | head -18
    done
    ;;
decode48)
    timeout 560 python3 bench/decode.py --layers 48 2>&1 | quiet | tail -20
    ;;
serve)
    timeout 290 python3 bench/serve_load.py --layers 6 --clients 1,16,64 2>&1 | quiet | tail -14
    ;;
serve48)
    timeout 580 python3 bench/serve_load.py --layers 48 --clients 1,16,64,256 2>&1 | quiet | tail -16
    ;;
esac
