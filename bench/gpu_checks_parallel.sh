#!/usr/bin/env bash
# The GPU checks of the FSDP, pipeline, end-to-end and model-family work on a machine with 2 GPUs,
# in parts that fit a device call each (10 minutes). Logs go to $LOGS; $OUT (or ./gpu_checks_out)
# receives only the loss plot and metrics, as the device tool returns at most 8 files a call.
#   bash bench/gpu_checks_parallel.sh singles   one-GPU jobs, two queues side by side:
#       GPU 0: the kernels' GPU tests, then the full step vs transformers (bench/e2e.py), then
#              gpt_oss's and gemma4's GPU configs for 3 bf16 steps;
#       GPU 1: the benchmark model under `moemesh train` for 200 steps (speed, loss curve), the
#              same for 50 steps in bf16 and in float32 (bench/compare_runs.py compares them), then
#              deepseek_v2's and v3's GPU configs.
#   bash bench/gpu_checks_parallel.sh pairs     both GPUs: EP=2 and dp_shard=2 (with and without
#       resharding after forward) against the one-GPU figure of `singles`; the pipeline schedules
#       on gpu_small and on the GPU-bound benchmark model (memory vs estimate, bubble).
#   bash bench/gpu_checks_parallel.sh fsdp      FSDP vs replicated (memory, prefetch overlap).
# On a machine with 4 GPUs (issue 48), through `moemesh train` and its step:
#   bash bench/gpu_checks_parallel.sh scaling [ep|dp_shard]   the benchmark model (6 layers) with 4
#       sequences of 4096 tokens per GPU on 1 GPU and on 2 side by side, then on 4, the GPUs
#       splitting that axis (ep: with each dispatcher, the new kernels' GPU tests first): tokens/s
#       per GPU and MFU (median of steps 3-12), peak memory.
#   bash bench/gpu_checks_parallel.sh full [VARIANTS] [--micro N ...]   the full Qwen3-30B-A3B
#       shape's layouts through the trainer's step (bench/pipeline.py; default: both dispatchers).
#   bash bench/gpu_checks_parallel.sh balance   the 6-layer shape's trainer step under ep=2 (GPUs
#       2-3) and ep=4, with the model's router and with spread (balanced) routing: the GPUs' idle
#       share from the mechanism alone and from the router's imbalance (bench/pipeline.py --routing)
#   bash bench/gpu_checks_parallel.sh graphs    the EP step as one CUDA graph with paired
#       micro-batches: the benchmark model under `moemesh train` on GPU 1 and with ep=2 on GPUs
#       2-3 side by side, then ep=4 (the same tokens per GPU); then the trainer's step with 8
#       micro-batches of one sequence a GPU, ep=2 and ep=4.
#   bash bench/gpu_checks_parallel.sh long STEPS [KEY=VALUE ...]   the full shape under `moemesh
#       train` for STEPS steps (the loss falling; tokens/s per GPU, MFU, memory from metrics.jsonl).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-gpu_checks_out}
LOGS=${LOGS:-/tmp/moemesh_gpu_checks}
mkdir -p "$OUT" "$LOGS"
quiet() { grep -v "^W1\|UserWarning\|_warn_once\|warnings.warn"; }
train() {  # GPU, log name, config, overrides...: one run of moemesh train, logged under $LOGS
    local gpu=$1 name=$2 config=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout 300 python3 -m moemesh train --config "$config" --set train.save_every=-1 \
        "train.run_dir=$LOGS/$name" "$@" > "$LOGS/$name.txt" 2>&1
}
count() { echo $(($(tr -cd , <<< "$1" | wc -c) + 1)); }  # GPUs in a list such as 0,1,2
run() {  # GPUs, log name, config, overrides...: moemesh train under torchrun on those GPUs
    local gpus=$1 name=$2 config=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout 420 torchrun --standalone --nproc-per-node "$(count "$gpus")" \
        -m moemesh train --config "$config" --set train.save_every=-1 train.log_every=1 "train.run_dir=$LOGS/$name" "$@" \
        > "$LOGS/$name.txt" 2>&1
}
summary() {  # log names...: a row each from its run's metrics.jsonl (steps 3 on)
    python3 - "$@" <<'PY'
import json, statistics, sys, os
logs = os.environ.get("LOGS", "/tmp/moemesh_gpu_checks")
print("| run | steps | loss first → last | tokens/s per GPU | MFU | peak GiB (rank 0) |")
print("|---|---|---|---|---|---|")
for name in sys.argv[1:]:
    try:
        records = [json.loads(l) for l in open(f"{logs}/{name}/metrics.jsonl") if '"loss"' in l]
    except OSError:
        print(f"| {name} | failed | | | | |"); continue
    later = [r for r in records if r["step"] >= 3] or records
    tps = statistics.median(r["tokens_per_s"] for r in later)
    mfu = statistics.median(r.get("mfu", 0) for r in later)
    n = int(os.environ.get(f"GPUS_{name}", "1"))  # tokens_per_s is the whole step's
    print(f"| {name} | {len(records)} | {records[0]['loss']:.3f} → {records[-1]['loss']:.3f} | {tps / n:,.0f} | "
          f"{mfu:.1%} | {max(r['max_memory_bytes'] for r in records) / 2**30:.1f} |")
PY
}
family() {  # family, GPU: the family's GPU config for 3 steps
    train "$2" "$1" "configs/$1_gpu.toml" train.steps=3 train.eval_every=0 train.log_every=1
}
case "${1:-singles}" in
singles)
    Q6=configs/qwen3_30b_a3b_6l.toml
    (CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q tests/test_ops_rms_norm.py tests/test_ops_combine.py \
         tests/test_ops_linear_cross_entropy.py tests/test_gpu_bf16.py > "$LOGS/gpu_tests.txt" 2>&1
     CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/e2e.py --steps 3 --warmup 1 > "$LOGS/e2e1.txt" 2>&1
     family gpt_oss 0; family gemma4 0) &
    (train 1 q6_200 $Q6 train.log_every=20
     cp "$LOGS/q6_200/loss.png" "$LOGS/q6_200/metrics.jsonl" "$OUT/"
     train 1 q6_50_bf16 $Q6 train.steps=50 train.eval_every=25 train.dtype=bfloat16
     train 1 q6_50_fp32 $Q6 train.steps=50 train.eval_every=25 train.dtype=float32 \
         train.param_dtype=float32 train.micro_batch=1  # float32 activations of 4 sequences do not fit
     python3 bench/compare_runs.py "$LOGS/q6_50_fp32" "$LOGS/q6_50_bf16" --tolerance 0.25 \
         --plot "$OUT/bf16_vs_fp32.png" --labels float32 bf16 > "$LOGS/compare.txt" 2>&1
     family deepseek_v2 1; family deepseek_v3 1) &
    wait
    echo "== GPU tests"; tail -2 "$LOGS/gpu_tests.txt"
    echo "== the full step vs transformers, one GPU"; quiet < "$LOGS/e2e1.txt" | tail -24
    echo "== the benchmark model under moemesh train, 200 steps"; quiet < "$LOGS/q6_200.txt" | tail -6
    echo "== bf16 vs float32, 50 steps"; tail -3 "$LOGS/compare.txt"
    for f in gpt_oss gemma4 deepseek_v2 deepseek_v3; do echo "== configs/${f}_gpu.toml, 3 steps"; quiet < "$LOGS/$f.txt" | tail -3; done
    ;;
pairs)
    ONE_GPU=$(grep -s "moemesh (bf16)" "$LOGS/e2e1.txt" | head -1 | awk -F'|' '{gsub(/[ ,]/, "", $4); print $4}')
    for layout in "ep" "dp_shard" "dp_shard --no-reshard"; do
        echo "== the full step, two GPUs, $layout"
        timeout 150 torchrun --nproc-per-node 2 bench/e2e.py --layout $layout --steps 3 --warmup 1 \
            --single-gpu-baseline "${ONE_GPU:-81236}" 2>&1 | quiet | grep "|" | head -3
    done
    echo "== pipeline schedules, configs/gpu_small.toml"
    timeout 200 torchrun --nproc-per-node 2 bench/pipeline.py 2>&1 | quiet | grep "|" | tail -5
    echo "== pipeline schedules, the benchmark model"
    timeout 200 torchrun --nproc-per-node 2 bench/pipeline.py --config configs/qwen3_30b_a3b_6l.toml --seq 4096 \
        --micro 1 --set train.param_dtype=bfloat16 --variants dualpipev,1f1b 2>&1 | quiet | grep "|" | tail -4
    ;;
fsdp)
    echo "== FSDP vs replicated"; torchrun --nproc-per-node 2 bench/fsdp.py 2>&1 | quiet | tail -8
    ;;
scaling)  # [AXIS]: the axis the GPUs split, ep (default: both dispatchers, the new kernels' tests first) or dp_shard
    axis=${2:-ep}
    if [ "$axis" = ep ]; then
        timeout 240 python3 -m pytest -q tests/test_ops_grouped_mm.py tests/test_ops_permute.py > "$LOGS/gpu_tests.txt" 2>&1
        echo "== the new kernels' GPU tests"; tail -2 "$LOGS/gpu_tests.txt"
    fi
    Q6=configs/qwen3_30b_a3b_6l.toml
    six() {  # GPUs, name, overrides: 4 sequences of 4096 tokens per GPU a step, 12 steps
        local n
        n=$(count "$1")
        run "$1" "$2" $Q6 train.steps=12 train.eval_every=0 train.global_batch=$((4 * n)) \
            train.micro_batch=$((4 * n)) parallel.$axis=$n "${@:3}"
    }
    six 0 q6_gpus1 & six 2,3 q6_${axis}2 & wait
    six 0,1,2,3 q6_${axis}4
    runs="q6_gpus1 q6_${axis}2 q6_${axis}4"
    if [ "$axis" = ep ]; then six 0,1,2,3 q6_ep4_all_to_all parallel.ep_dispatch=all_to_all; runs="$runs q6_ep4_all_to_all"; fi
    echo "== the benchmark model, the same tokens per GPU on 1, 2 and 4 GPUs ($axis)"
    declare -x "GPUS_q6_${axis}2=2" "GPUS_q6_${axis}4=4" GPUS_q6_ep4_all_to_all=4
    summary $runs
    for name in $runs; do quiet < "$LOGS/$name.txt" | grep -i "error\|computed again" | head -3; done
    ;;
full)
    variants=${2:-ep,ep-all_to_all}
    echo "== the full Qwen3-30B-A3B shape, 4 GPUs: $variants"
    timeout 540 torchrun --standalone --nproc-per-node 4 bench/pipeline.py --config configs/qwen3_30b_a3b.toml \
        --seq 4096 --steps 4 --warmup 2 --variants "$variants" "${@:3}" 2>&1 | tee "$LOGS/full_$variants.txt" | quiet | tail -40
    ;;
graphs)
    Q6=configs/qwen3_30b_a3b_6l.toml
    GRAPHS="parallel.pp_overlap=true train.cuda_graphs=true"
    six() {  # GPUs, name, overrides: 4 sequences of 4096 tokens per GPU a step, micro-batches of one a GPU
        local n
        n=$(count "$1")
        run "$1" "$2" $Q6 train.steps=12 train.eval_every=0 train.global_batch=$((4 * n)) "${@:3}"
    }
    six 1 q6_gpus1 train.micro_batch=4 & six 2,3 q6_ep2_graphs train.micro_batch=2 parallel.ep=2 $GRAPHS & wait
    six 0,1,2,3 q6_ep4_graphs train.micro_batch=4 parallel.ep=4 $GRAPHS
    echo "== the benchmark model, 4 sequences of 4096 tokens a GPU, the EP step as one graph with pairs"
    declare -x GPUS_q6_ep2_graphs=2 GPUS_q6_ep4_graphs=4
    summary q6_gpus1 q6_ep2_graphs q6_ep4_graphs
    for name in q6_gpus1 q6_ep2_graphs q6_ep4_graphs; do quiet < "$LOGS/$name.txt" | grep -i "error\|computed again\|captur" | head -4; done
    for gpus in 2,3 0,1,2,3; do
        n=$(count $gpus)
        echo "== the trainer's step, ep=$n, 8 micro-batches of one sequence a GPU"
        CUDA_VISIBLE_DEVICES=$gpus timeout 240 torchrun --standalone --nproc-per-node "$n" bench/pipeline.py \
            --config $Q6 --seq 4096 --micro "$n" --micro-batches 8 --steps 4 --warmup 2 \
            --variants ep-graphs,ep-paired-graphs 2>&1 | tee "$LOGS/graphs8_$n.txt" | quiet | grep "|\|Error"
    done
    ;;
balance)
    six() {  # GPUs, micro-batches, sequences a micro-batch
        CUDA_VISIBLE_DEVICES=$1 timeout 280 torchrun --standalone --nproc-per-node "$(count "$1")" bench/pipeline.py \
            --config configs/qwen3_30b_a3b_6l.toml --seq 4096 --micro "$3" --micro-batches "$2" --steps 4 --warmup 2 \
            --variants ep --routing model,spread 2>&1 | tee "$LOGS/balance_$1.txt" | quiet | grep "|\|Error"
    }
    six "${GPUS2:-2,3}" 8 2
    six 0,1,2,3 4 4
    ;;
long)
    run 0,1,2,3 full_long configs/qwen3_30b_a3b.toml train.steps="$2" train.eval_every=0 "${@:3}"
    quiet < "$LOGS/full_long.txt" | tail -5
    GPUS_full_long=4 summary full_long
    cp "$LOGS/full_long/loss.png" "$OUT/full_long_loss.png" 2>/dev/null
    ;;
esac
