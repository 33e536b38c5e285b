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
#   bash bench/gpu_checks_inference.sh invariant  batch-invariant mode (issue 50): the GPU tests of its
#       kernels (compiled, bf16 included); the 48-layer shape's decode step at batch 1 and 64 as
#       shipped and in the mode, and the mode's bit-equality in bf16 — 64 sequences of 160 tokens
#       together (chunked, cached, preempted) against 4 alone and against the trainer's forward
#       (bench/decode.py --batch-invariant)
#   bash bench/gpu_checks_inference.sh invariant-cost  the same mode's price on 4 GPUs: GPU 0 the
#       `invariant` case alone, then side by side: GPU 1 the matmul kernel's tiles (bench/kernels.py
#       --invariant-tiles); GPU 2 the offline workload of 64 prompts on the 48-layer shape as
#       shipped and in the mode (bench/serve_offline.py --batch-invariant); GPU 3 the 48-layer
#       weights handed to an engine in place and from another process (bench/load.py --hand-over
#       48 --ipc; two models on one GPU: 122 GB, an H200)
#   bash bench/gpu_checks_inference.sh invariant-profile  the kernels of a 48-layer decode step at
#       batch 64, as shipped and in the mode (bench/decode.py --profile-steps --batch-invariant)
#   bash bench/gpu_checks_inference.sh invariant-train  the trainer's side of the mode on 2 GPUs:
#       GPU 0 the attention kernel's tiles and its forward and backward against torch's attention
#       (bench/kernels.py --invariant-attention), then the training step's model part at 4 × 2,048
#       tokens (24 layers) and 4 × 416 (48 layers), as shipped and in the mode, and the GPU tests of
#       the mode's kernels; GPU 1 the matmul's picked tiles, in grouped order and M tile first
#       (--invariant-tiles --picked-tiles), then the `invariant` case's bit-equality check
# On a machine with 4 GPUs (issue 49), tensor parallelism:
#   bash bench/gpu_checks_inference.sh tp       the all-reduce alone on 2 (and 4) GPUs, each way and
#       size (bench/decode.py --all-reduce); the 48-layer shape's decode step at batch 1 and 64 on
#       1, 2 (and 4) GPUs, each way of summing (--tensor-parallel); the same for
#       configs/gemma4_26b_a4b.toml on 1, 2 (and 4) GPUs
#   bash bench/gpu_checks_inference.sh launches  the decode step of the 48-layer shape at batch 1
#       and 64 as shipped and as before its dependent launches and fused residual adds
#       (--step-variants shipped,before) on 1 GPU, beside the GPU tests of those kernels and the
#       per-expert kernel's tiles (bench/kernels.py --expert-tiles) on another; then on 2 GPUs
#       (and 4, on a 4-GPU host)
#   bash bench/gpu_checks_inference.sh sums     on 4 GPUs: the GPU tests of the norm kernels; the
#       all-reduce alone and inside the residual add and norm (bench/decode.py --all-reduce) on 2
#       and 4; the 48-layer step at batch 1 and 64 with the sums in the norms and apart
#       (--step-variants shipped,sums-apart) on 1 and 2 GPUs side by side, then on 4
#   bash bench/gpu_checks_inference.sh profiles  on 4 GPUs: the kernels of the training step's model
#       part as shipped and in batch-invariant mode (bench/decode.py --profile-scoring) beside those of
#       the 48-layer decode step at batch 64 (PROFILE_BATCH) on 1 and 2 GPUs, then on 4
#       (PROFILE_VARIANT=plain-launch: each kernel's own time, not a dependent launch's wait too)
#   bash bench/gpu_checks_inference.sh gemv-tiles  on 1 GPU: decoding's projections of the 48-layer
#       shape at 1, 2 and 4 GPUs' shares, every tile of ops/gemv.py and cuBLAS, timed inside CUDA
#       graphs (bench/kernels.py --gemv-tiles)
#   bash bench/gpu_checks_inference.sh tp-ep  on 4 GPUs, the 48-layer step at batch 1, 64 and 256 on
#       1 GPU, then on 2 and 4 with the experts sliced (tp) and whole (--layout tp-ep)
#   bash bench/gpu_checks_inference.sh tp-ep-profile  on 4 GPUs, rank 0's kernels of the 48-layer step
#       at batch ${PROFILE_BATCH:-64}, launched plainly, with the experts sliced and whole: TP=2 both
#       ways side by side, then TP=4 each way
#   bash bench/gpu_checks_inference.sh ep4      on 4 GPUs, the 48-layer step at batch 1, 64 and 256
#       with the experts split over 4 (--layout ep) and with tp=4
#   bash bench/gpu_checks_inference.sh serve-tp N MODEL...   `moemesh serve` over N GPUs of a
#       random-weight MODEL (a config; default the 48-layer Qwen3-30B-A3B shape) under 1 and 64
#       openai clients, beside the engine alone (serve_load.py --tp N; more of its options in
#       SERVE_LOAD_ARGS, e.g. "--reply-windows 10,25")
#   bash bench/gpu_checks_inference.sh serve235   Qwen3-235B-A22B (configs/qwen3_235b_a22b.toml,
#       weights drawn from the seed on each rank) served by `torchrun -m moemesh serve --tp 4`:
#       the openai client's answer, batch-1 ms a token, 64 clients' tokens/s, the server's log
#       (KV capacity); `serve235 configs/tiny.toml 2` is a CPU dry run
# Packages the image lacks (fastapi, uvicorn and theirs) travel as wheels in .whl (device README).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
tp_decode() {  # GPUs, log name, decode.py options...: the engine's step under torchrun on those GPUs
    local gpus=$1 name=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$gpus timeout 400 torchrun --standalone --nproc-per-node $(($(tr -cd , <<< "$gpus" | wc -c) + 1)) \
        bench/decode.py --tensor-parallel --prompt-len 128 --new-tokens 64 --batches 1,64 "$@" > "$LOGS/$name.txt" 2>&1
}
profiled() {  # step variant: decode.py's options for rank 0's kernels of 16 steps of the 48-layer shape
    echo "--layers 48 --profile-steps 16 --profile-batch ${PROFILE_BATCH:-64} --step-variants $1"
}
export LOGS=${LOGS:-/tmp/moemesh_gpu_checks}
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
invariant)
    timeout 150 python3 -m pytest -q tests/test_batch_invariant.py -k kernel > "$LOGS/invariant_tests.txt" 2>&1
    echo "== GPU tests"; grep -E "passed|failed|Error" "$LOGS/invariant_tests.txt" | tail -5
    timeout 440 python3 bench/decode.py --layers 48 --batch-invariant --batches 1,64 --prompt-len 256 \
        --new-tokens 32 --check-tokens 160 ${GRAPHS:+--invariant-graphs} 2>&1 | quiet | grep -v "^$" | tail -${ROWS:-24}
    ;;
invariant-cost)  # the `invariant` case first, alone on the host (its small steps feel the others' host load)
    CUDA_VISIBLE_DEVICES=0 ROWS=40 bash "$0" invariant
    CUDA_VISIBLE_DEVICES=1 timeout 500 python3 bench/kernels.py --invariant-tiles > "$LOGS/tiles.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=2 timeout 500 python3 bench/serve_offline.py --layers 48 --prompts 64 --new-tokens 128 \
        --batch-invariant --invariant-graphs on --no-transformers --prefill-len 0 --prefix-len 0 \
        > "$LOGS/offline_invariant.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=3 timeout 500 python3 bench/load.py --hand-over 48 --ipc > "$LOGS/hand_over.txt" 2>&1 &
    wait
    echo "== hand-over"; quiet < "$LOGS/hand_over.txt" | grep -v "^$" | tail -8
    echo "== tiles"; grep -v "^$" "$LOGS/tiles.txt" | tail -40
    echo "== offline"; quiet < "$LOGS/offline_invariant.txt" | grep "|" | tail -8
    ;;
invariant-train)
    score() { timeout 200 python3 bench/decode.py --batch-invariant --score-only --batches 4 "$@" 2>&1 | quiet | grep "|"; }
    (export CUDA_VISIBLE_DEVICES=0; timeout 200 python3 bench/kernels.py --invariant-attention 2>&1 | grep -v "^$"
        score --layers 24 --prompt-len 1024 --check-tokens 1024
        score --layers 48 --prompt-len 256 --check-tokens 160
        timeout 100 python3 -m pytest -q tests/test_batch_invariant.py -k kernel 2>&1 | tail -3) > "$LOGS/train.txt" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; timeout 120 python3 bench/kernels.py --invariant-tiles --picked-tiles 2>&1 | grep -v "^$"
        timeout 440 python3 bench/decode.py --layers 48 --batch-invariant --batches 1,64 --prompt-len 256 \
            --new-tokens 32 --check-tokens 160 2>&1 | quiet | grep -v "^$" | tail -40) > "$LOGS/train_tiles.txt" 2>&1 &
    wait
    echo "== attention, the training step"; cat "$LOGS/train.txt"
    echo "== the matmul's picked tiles, the invariant check"; cat "$LOGS/train_tiles.txt"
    ;;
invariant-profile)  # where the mode's decode step goes: the kernels of a step at batch 64, both ways
    for mode in "" --batch-invariant; do
        timeout 280 python3 bench/decode.py --layers 48 --prompt-len 256 --profile-steps 16 --profile-batch 64 \
            $mode 2>&1 | quiet | grep "|" | head -24
    done
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
tp)  # on 2 GPUs: 1 then 2; on 4: 1 and 2 side by side, then 4
    gpus=$(nvidia-smi -L | wc -l)
    sizes=2; [ "$gpus" -ge 4 ] && sizes="2 4"
    for n in $sizes; do
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 200 torchrun --standalone --nproc-per-node $n \
            bench/decode.py --all-reduce > "$LOGS/all_reduce$n.txt" 2>&1
        echo "== the all-reduce alone, $n GPUs"; quiet < "$LOGS/all_reduce$n.txt" | grep "|\|Error"
    done
    shown() { for name in "$@"; do echo "== $name"; quiet < "$LOGS/$name.txt" | grep "|\|Error"; done; }
    if [ "$gpus" -ge 4 ]; then  # the 48-layer shape on 1 and 2 GPUs side by side, then on 4; Gemma-4 the same
        tp_decode 0 tp1 --layers 48 --batches 1,64,256 & tp_decode 2,3 tp2 --layers 48 & wait
        shown tp1 tp2
        tp_decode 0,1,2,3 tp4 --layers 48; shown tp4
        tp_decode 0 gemma1 --config configs/gemma4_26b_a4b.toml &
        tp_decode 2,3 gemma2 --config configs/gemma4_26b_a4b.toml --ways nccl,shipped & wait
        shown gemma1 gemma2
        tp_decode 0,1,2,3 gemma4 --config configs/gemma4_26b_a4b.toml --ways nccl,shipped; shown gemma4
    else
        tp_decode 0 tp1 --layers 48; tp_decode 0,1 tp2 --layers 48; shown tp1 tp2
        tp_decode 0 gemma1 --config configs/gemma4_26b_a4b.toml
        tp_decode 0,1 gemma2 --config configs/gemma4_26b_a4b.toml --ways nccl,shipped; shown gemma1 gemma2
    fi
    ;;
launches)
    variants="--ways shipped --step-variants ${VARIANTS:-shipped,before} ${DECODE_ARGS:-}"
    (CUDA_VISIBLE_DEVICES=1 timeout ${TEST_S:-200} python3 -m pytest -q ${TESTS:-tests/test_ops_rms_norm.py \
        tests/test_ops_decode_kernels.py tests/test_models_decoding.py} > "$LOGS/launch_tests.txt" 2>&1
     [ -z "${NO_TILES:-}" ] && CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/kernels.py --expert-tiles \
        > "$LOGS/expert_tiles.txt" 2>&1) &
    tp_decode 0 step1 --layers 48 $variants
    wait
    echo "== GPU tests"; grep -E "passed|failed|Error" "$LOGS/launch_tests.txt" | tail -5
    [ -z "${NO_TILES:-}" ] && { echo "== the per-expert kernel's tiles"; grep -v "^$" "$LOGS/expert_tiles.txt" | tail -16; }
    echo "== 1 GPU"; quiet < "$LOGS/step1.txt" | grep "|\|Error"
    tp_decode 0,1 step2 --layers 48 $variants
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && tp_decode 0,1,2,3 step4 --layers 48 $variants
    for n in 2 4; do [ -f "$LOGS/step$n.txt" ] && { echo "== $n GPUs"; quiet < "$LOGS/step$n.txt" | grep "|\|Error"; }; done
    ;;
sums)  # the all-reduce inside the norm (ops/summed_norm.py), on a 4-GPU host
    CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q tests/test_ops_summed_norm.py tests/test_ops_rms_norm.py \
        tests/test_models_decoding.py > "$LOGS/sums_tests.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 timeout 200 torchrun --standalone --nproc-per-node 2 bench/decode.py --all-reduce \
        --all-reduce-sizes 4,16,64,256,512 --ways nccl,shipped > "$LOGS/sums_all_reduce2.txt" 2>&1
    wait
    echo "== GPU tests"; grep -E "passed|failed|Error" "$LOGS/sums_tests.txt" | tail -5
    timeout 200 torchrun --standalone --nproc-per-node 4 bench/decode.py --all-reduce \
        --all-reduce-sizes 4,16,64,256,512 --ways nccl,shipped > "$LOGS/sums_all_reduce4.txt" 2>&1
    for n in 2 4; do echo "== the all-reduce alone and in the norm, $n GPUs"; quiet < "$LOGS/sums_all_reduce$n.txt" | grep "|\|Error"; done
    variants="--layers 48 --ways shipped --step-variants ${VARIANTS:-shipped,sums-apart} ${DECODE_ARGS:---new-tokens 40}"
    tp_decode 0 sums1 $variants & tp_decode 2,3 sums2 $variants & wait
    tp_decode 0,1,2,3 sums4 $variants
    for n in 1 2 4; do echo "== $n GPUs"; quiet < "$LOGS/sums$n.txt" | grep "|\|Error"; done
    ;;
profiles)  # on 4 GPUs: where the time goes. GPU 0: the training step's model part as shipped and in
    # batch-invariant mode (4 sequences of 416 tokens); GPU 1: one GPU's decode step, GPUs 2-3: TP=2's,
    # then all four: TP=4's, rank 0's kernels at batch ${PROFILE_BATCH:-64}
    CUDA_VISIBLE_DEVICES=0 timeout 400 python3 bench/decode.py --layers 48 --batch-invariant --profile-scoring \
        --batches 4 --prompt-len 256 --check-tokens 160 > "$LOGS/scoring_profile.txt" 2>&1 &
    args=$(profiled "${PROFILE_VARIANT:-shipped}")
    tp_decode 1 profile1 $args & tp_decode 2,3 profile2 $args & wait
    tp_decode 0,1,2,3 profile4 $args
    echo "== the training step"; quiet < "$LOGS/scoring_profile.txt" | grep "|\|Error\|##"
    for n in 1 2 4; do echo "== $n GPUs"; quiet < "$LOGS/profile$n.txt" | grep "|\|Error" | head -28; done
    ;;
gemv-tiles)  # decoding's projections alone, every tile of ops/gemv.py against cuBLAS, in CUDA graphs
    timeout 400 python3 bench/kernels.py --gemv-tiles > "$LOGS/gemv_tiles.txt" 2>&1
    quiet < "$LOGS/gemv_tiles.txt" | grep -v "^ *$"
    ;;
tp-ep)  # on 4 GPUs: tensor parallelism with whole experts (`serve --tp N --ep N`) against expert slices
    args="--layers 48 --ways shipped --batches 1,64,256 --new-tokens 40"
    tp_decode 0 tpep1 $args & tp_decode 2,3 tpep2_tp $args & wait
    tp_decode 0,1 tpep2_whole $args --layout tp-ep
    tp_decode 0,1,2,3 tpep4_tp $args
    tp_decode 0,1,2,3 tpep4_whole $args --layout tp-ep
    for name in tpep1 tpep2_tp tpep2_whole tpep4_tp tpep4_whole; do
        echo "== $name"; quiet < "$LOGS/$name.txt" | grep "|\|Error"
    done
    ;;
tp-ep-profile)
    args=$(profiled plain-launch)
    tp_decode 0,1 tpep_profile2_tp $args & tp_decode 2,3 tpep_profile2_whole $args --layout tp-ep & wait
    tp_decode 0,1,2,3 tpep_profile4_tp $args
    tp_decode 0,1,2,3 tpep_profile4_whole $args --layout tp-ep
    for name in 2_tp 2_whole 4_tp 4_whole; do
        echo "== $name"; quiet < "$LOGS/tpep_profile$name.txt" | grep "|\|Error" | head -28
    done
    ;;
ep4)  # on 4 GPUs: experts split over 4 (attention whole on each) against tp=4, batch 1, 64 and 256
    for layout in ep tp; do
        tp_decode 0,1,2,3 ${layout}4_large --layers 48 --layout $layout --ways shipped --batches 1,64,256 --new-tokens 32
        echo "== the 48-layer decode step, $layout=4"; quiet < "$LOGS/${layout}4_large.txt" | grep "|\|Error"
    done
    ;;
serve-tp)
    model=${3:+--config $3}
    timeout 560 python3 bench/serve_load.py ${model:---layers 48} --clients 1,64 --tp "$2" --long-prompt 0 \
        ${SERVE_LOAD_ARGS:-} 2>&1 | quiet | tail -12
    ;;
serve235)  # [CONFIG N]: another config over N processes (a CPU dry run: configs/tiny.toml 2)
    CONFIG=${2:-configs/qwen3_235b_a22b.toml} GPUS=${3:-4} python3 - <<'PY' 2>&1 | quiet | tail -30
import os, subprocess, sys, time, json, urllib.request
log = open(os.environ.get("LOGS", "/tmp") + "/serve235.txt", "w")
config, gpus = os.environ["CONFIG"], os.environ["GPUS"]
name = os.path.splitext(os.path.basename(config))[0]
server = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", gpus,
    "-m", "moemesh", "serve", "--config", config, "--tp", gpus, "--port", "8031", "--max-len", "8192"],
    stdout=log, stderr=subprocess.STDOUT)
start = time.time()
try:
    while True:
        try:
            urllib.request.urlopen("http://127.0.0.1:8031/v1/models", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() - start > 420:
                raise SystemExit(f"the server did not come up ({server.poll()}): see {log.name}")
            time.sleep(2)
    print(f"up in {time.time() - start:.0f} s")
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8031/v1", api_key="none")
    reply = client.completions.create(model=name, prompt="Hello", max_tokens=8)  # bytes: no chat template
    print("answer:", repr(reply.choices[0].text), reply.usage)
    def timed(n_clients, tokens):
        import concurrent.futures as cf
        def one(i):
            r = client.completions.create(model=name, prompt="x" * 128 + str(i), max_tokens=tokens,
                                          temperature=0)  # tokens counted: an end-of-text token may stop one early
            return r.usage.completion_tokens
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(n_clients) as pool:
            made = sum(pool.map(one, range(n_clients)))
        return made, time.perf_counter() - t
    timed(1, 128); timed(64, 128)  # the same runs first: the decode graphs of a longer context are captured at first use
    made1, s1 = timed(1, 128)
    made64, s64 = timed(64, 128)
    print(f"batch 1: {made1} tokens in {s1:.2f} s: {s1 * 1e3 / made1:.2f} ms a token (prompt included)")
    print(f"64 clients: {made64} tokens in {s64:.2f} s: {made64 / s64:,.0f} tokens/s")
finally:
    server.terminate()
    server.wait(timeout=60)
    log.close()
    print("".join(line for line in open(log.name) if line.startswith(("moemesh", "[rank"))))  # its own lines
PY
    ;;
esac
