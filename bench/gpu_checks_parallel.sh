#!/usr/bin/env bash
# The checks of the FSDP, pipeline, end-to-end and model-family work on a machine with 2 GPUs, in
# two parts of about 7 minutes each, to fit a device call apiece (results under $OUT, or ./gpu_checks_out):
#   bash bench/gpu_checks_parallel.sh benches     bash bench/gpu_checks_parallel.sh runs
# - FSDP vs replicated (memory, prefetch overlap), DualPipeV vs 1F1B vs EP (memory vs estimate, bubble);
# - the full step vs transformers on one GPU, then EP=2 and dp_shard=2 scaling against it;
# - the benchmark model under `moemesh train` for 200 steps (speed, loss curve);
# - each model family's GPU config for a few bf16 steps.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
quiet() { grep -v "^W1\|UserWarning\|_warn_once"; }
PART=${1:-benches}
if [ "$PART" = benches ]; then
echo "== FSDP vs replicated"; torchrun --nproc-per-node 2 bench/fsdp.py 2>&1 | quiet | tail -8
echo "== pipeline schedules"; torchrun --nproc-per-node 2 bench/pipeline.py 2>&1 | quiet | tail -6
echo "== the full step vs transformers, one GPU"
CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py > "$OUT/e2e1.txt" 2>&1; quiet < "$OUT/e2e1.txt" | tail -20
ONE_GPU=$(grep "moemesh (bf16)" "$OUT/e2e1.txt" | head -1 | awk -F'|' '{gsub(/[ ,]/, "", $4); print $4}')
for layout in ep dp_shard; do
    echo "== the same, two GPUs, $layout=2"
    torchrun --nproc-per-node 2 bench/e2e.py --layout $layout --single-gpu-baseline "${ONE_GPU:-1}" 2>&1 | quiet | grep "|" | head -3
done
else
echo "== the benchmark model under moemesh train, 200 steps"
CUDA_VISIBLE_DEVICES=0 python3 -m moemesh train --config configs/qwen3_30b_a3b_6l.toml \
    --set train.save_every=-1 "train.run_dir=$OUT/qwen3_30b_a3b_6l" train.log_every=20 2>&1 | tail -14
for family in gpt_oss deepseek_v2 deepseek_v3 gemma4; do
    echo "== configs/${family}_gpu.toml, 3 steps"
    CUDA_VISIBLE_DEVICES=0 python3 -m moemesh train --config "configs/${family}_gpu.toml" \
        --set train.steps=3 train.eval_every=0 train.save_every=-1 train.log_every=1 \
        "train.run_dir=/tmp/moemesh_runs/$family" 2>&1 | tail -3
done
fi
