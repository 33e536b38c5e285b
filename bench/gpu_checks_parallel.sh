#!/usr/bin/env bash
# The checks of the FSDP, pipeline, end-to-end and model-family work on a machine with 2 GPUs, in
# parts that fit a device call each (results and traces under $OUT, or ./gpu_checks_out):
#   bash bench/gpu_checks_parallel.sh singles   one-GPU jobs, two queues side by side (one per GPU):
#       GPU 0: the benchmark model under `moemesh train` for 200 steps (speed, loss curve), then
#              gpt_oss and gemma4's GPU configs for 3 bf16 steps;
#       GPU 1: the full step vs transformers (bench/e2e.py), then deepseek_v2 and v3's GPU configs,
#              then what a layer saves for backward against the memory estimate (bench/saved_tensors.py).
#   bash bench/gpu_checks_parallel.sh pairs     both GPUs: EP=2 and dp_shard=2 scaling (against the
#       one-GPU figure of `singles` when its output is there), DualPipeV vs 1F1B vs EP (memory vs
#       estimate, bubble, per-operation traces).
#   bash bench/gpu_checks_parallel.sh fsdp      FSDP vs replicated (memory, prefetch overlap).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
quiet() { grep -v "^W1\|UserWarning\|_warn_once\|warnings.warn"; }
family() {  # family, GPU: the family's GPU config for 3 steps
    CUDA_VISIBLE_DEVICES=$2 timeout 150 python3 -m moemesh train --config "configs/$1_gpu.toml" \
        --set train.steps=3 train.eval_every=0 train.save_every=-1 train.log_every=1 \
        "train.run_dir=/tmp/moemesh_runs/$1" > "$OUT/$1.txt" 2>&1
}
case "${1:-singles}" in
singles)
    (CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m moemesh train --config configs/qwen3_30b_a3b_6l.toml \
         --set train.save_every=-1 train.run_dir=/tmp/moemesh_runs/qwen3_30b_a3b_6l train.log_every=10 \
         > "$OUT/train200.txt" 2>&1; cp /tmp/moemesh_runs/qwen3_30b_a3b_6l/{loss.png,metrics.jsonl} "$OUT/"
     family gpt_oss 0; family gemma4 0) &
    (CUDA_VISIBLE_DEVICES=1 timeout 240 python3 bench/e2e.py --steps 3 --warmup 1 --trace-dir "$OUT" \
         > "$OUT/e2e1.txt" 2>&1; family deepseek_v2 1; family deepseek_v3 1
     CUDA_VISIBLE_DEVICES=1 timeout 120 python3 bench/saved_tensors.py > "$OUT/saved_tensors.txt" 2>&1) &
    wait
    echo "== the benchmark model under moemesh train, 200 steps"; quiet < "$OUT/train200.txt" | tail -30
    echo "== saved tensors per layer vs the analytical estimate"; quiet < "$OUT/saved_tensors.txt" | tail -40
    echo "== the full step vs transformers, one GPU"; quiet < "$OUT/e2e1.txt" | tail -24
    for f in gpt_oss gemma4 deepseek_v2 deepseek_v3; do echo "== configs/${f}_gpu.toml, 3 steps"; quiet < "$OUT/$f.txt" | tail -4; done
    ;;
pairs)
    ONE_GPU=$(grep -s "moemesh (bf16)" "$OUT/e2e1.txt" | head -1 | awk -F'|' '{gsub(/[ ,]/, "", $4); print $4}')
    for layout in ep dp_shard; do
        echo "== the full step, two GPUs, $layout=2"
        timeout 150 torchrun --nproc-per-node 2 bench/e2e.py --layout $layout --steps 3 --warmup 1 \
            --single-gpu-baseline "${ONE_GPU:-72471}" --trace-dir "$OUT" 2>&1 | quiet | tail -18
    done
    echo "== pipeline schedules"
    timeout 240 torchrun --nproc-per-node 2 bench/pipeline.py --trace-dir "$OUT" 2>&1 | quiet | tail -16
    ;;
fsdp)
    echo "== FSDP vs replicated"; torchrun --nproc-per-node 2 bench/fsdp.py 2>&1 | quiet | tail -8
    ;;
esac
