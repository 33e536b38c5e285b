#!/usr/bin/env bash
# Everything this checkout checks and measures on a machine with 2 GPUs, in one go:
#   bash bench/gpu_checks.sh            (results under $OUT, or ./gpu_checks_out)
# - the kernel and bf16 tests on a GPU (compiled Triton, bf16 logits vs fp32);
# - configs/gpu_small.toml for a few steps on one GPU (tokens/s, MFU) and under EP=2 on two, the
#   two loss curves compared step by step;
# - EP dispatch+combine against a raw all-to-all of the same bytes;
# - the same training under TP=2, greedy generation under TP=2 against one GPU, and the MoE block
#   with its delayed all-reduce against an all-reduce per expert slot.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-gpu_checks_out}
RUNS=${RUNS:-/tmp/moemesh_runs}  # checkpoints are large: keep them out of $OUT
STEPS=${STEPS:-30}
mkdir -p "$OUT" "$RUNS"
nvidia-smi -L

echo "== tests on the GPU"
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_ops_*.py tests/test_gpu_bf16.py -s \
    > "$OUT/pytest_gpu.txt" 2>&1
grep -E "rel. error|passed|failed" "$OUT/pytest_gpu.txt"

train=(--config configs/gpu_small.toml --set "train.steps=$STEPS" train.eval_every=0 train.log_every=5
       train.overwrite=true)  # $RUNS may hold the checkpoints of an earlier round
echo "== configs/gpu_small.toml, $STEPS steps, one GPU"
CUDA_VISIBLE_DEVICES=0 python3 -m moemesh train "${train[@]}" "train.run_dir=$RUNS/gpu1" 2>&1 | tail -8
echo "== the same, EP=2 on two GPUs"
torchrun --nproc-per-node 2 -m moemesh train "${train[@]}" parallel.ep=2 "train.run_dir=$RUNS/ep2" 2>&1 | tail -8
python3 bench/compare_runs.py "$RUNS/gpu1" "$RUNS/ep2"
cp "$RUNS/gpu1/metrics.jsonl" "$OUT/gpu1_metrics.jsonl"; cp "$RUNS/ep2/metrics.jsonl" "$OUT/ep2_metrics.jsonl"

echo "== EP dispatch + combine vs raw all-to-all"
torchrun --nproc-per-node 2 bench/ep_alltoall.py 2>&1 | grep -v "^W1"

echo "== configs/gpu_small.toml, TP=2 on two GPUs"
torchrun --nproc-per-node 2 -m moemesh train "${train[@]}" parallel.tp=2 "train.run_dir=$RUNS/tp2" 2>&1 | tail -8
python3 bench/compare_runs.py "$RUNS/gpu1" "$RUNS/tp2"
cp "$RUNS/tp2/metrics.jsonl" "$OUT/tp2_metrics.jsonl"

echo "== greedy generation from the one-GPU run: one GPU, then TP=2 (fp32 on GPUs: may part after a near-tie)"
generate=(generate --checkpoint "$RUNS/gpu1" --prompt "def main(" --max-new-tokens 64)
CUDA_VISIBLE_DEVICES=0 python3 -m moemesh "${generate[@]}" > "$OUT/generate_gpu1.txt"
torchrun --nproc-per-node 2 -m moemesh "${generate[@]}" --tp 2 > "$OUT/generate_tp2.txt" 2> "$OUT/generate_tp2.err"
cat "$OUT/generate_gpu1.txt" "$OUT/generate_tp2.txt"
cmp -s "$OUT/generate_gpu1.txt" "$OUT/generate_tp2.txt" && echo "same text" || echo "the texts differ"

echo "== TP MoE block: delayed all-reduce vs an all-reduce per expert slot"
torchrun --nproc-per-node 2 bench/tp_moe.py 2>&1 | grep -v "^W1"
