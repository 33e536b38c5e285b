"""Generation under tensor parallelism (CPU, gloo, fp32) against one process: the same greedy
tokens, every rank sampling the same tokens, a KV cache of this rank's heads only, and
`torchrun ... moemesh generate --tp 2` printing what one process prints."""

import os
import subprocess
import sys

import torch

from moemesh.cli import main
from moemesh.inference.generate import generate
from moemesh.models import KVCache, ModelConfig, build
from moemesh.checkpoint.hf import save_pretrained
from moemesh.parallel import comm
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp
from multiprocess import WorkerPool
from tiny_run import TINY_MODEL

TP = 2
# Random weights with a wide initialisation: varied tokens, and no near-ties for the rounding
# differences of the sharded sums to flip.
CONFIG = ModelConfig(**TINY_MODEL, initializer_range=0.2)
PROMPT = [0, 100, 101, 102]


def check_generation(rank):
    expected = generate(build(CONFIG, seed=5), PROMPT, max_new_tokens=12)
    mesh = init_mesh(ParallelDims(tp=TP))
    model = apply_tp(build(CONFIG, seed=5), mesh).eval()
    comm.reset_counts()
    assert generate(model, PROMPT, max_new_tokens=12) == expected
    # one [1, V/tp] all-gather per step: the prompt's last position, then each new token but the last
    assert comm.calls[("all_gather", "forward")] == 12
    assert comm.sent_bytes[("all_gather", "forward")] == 12 * CONFIG.vocab_size // TP * 4

    cache = KVCache()
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache=cache)
    assert cache.keys[0].shape[1] == CONFIG.num_key_value_heads // TP  # [batch, heads, seq, head_dim]

    sampled = torch.tensor(generate(model, PROMPT, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3))
    comm.all_reduce_sum_([mine := sampled.clone()], mesh.group("tp"))
    assert torch.equal(mine, TP * sampled)  # every rank sampled the same tokens
    return True


def test_tp_generation_equals_one_process():
    pool = WorkerPool(TP)
    try:
        assert all(pool.run(check_generation))
    finally:
        pool.close()


def test_generate_command_under_torchrun(tmp_path, capsys):
    model = build(CONFIG, seed=5)
    save_pretrained(model, tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "checkpoint")]) == 0  # every rank loads it
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(tmp_path / "checkpoint"), "--prompt", "def ", "--max-new-tokens", "24"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    assert len(expected) > len("def \n")

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP),
                             "-m", "moemesh", *args, "--set", f"parallel.tp={TP}"], capture_output=True, text=True,
                            env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected  # rank 0 alone prints, the same text


def test_generate_refuses_a_layout_torchrun_did_not_launch(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "parallel layout pp=1 × dp_replicate=1 × dp_shard=1 × ep=1 × tp=3 needs 3 processes, but 1 were launched" in err


def test_generate_set_takes_only_the_tensor_parallel_size(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--set", "train.steps=3"]) == 2
    assert "generate --set takes only parallel.tp=N" in capsys.readouterr().err
