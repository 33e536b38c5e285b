"""Run under torchrun by test_parallel_memory.py: how much resident memory this rank gains while it
lays out and reads a model (and, training, while it takes one step), as the kernel counts it.

    python -m torch.distributed.run --nproc-per-node 4 tests/memory_probe.py train|generate MODEL_DIR RUN_DIR

Writes MODE-rankN.json beside RUN_DIR: the growth of VmHWM (the peak resident set, reset to the
current size with /proc/self/clear_refs once everything is imported) over setup and over the step."""

import io
import json
import sys
from pathlib import Path


def resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    import torch  # noqa: F401  (imported before the baseline)

    from moemesh.checkpoint.load import init_source
    from moemesh.config import config_from_dict
    from moemesh.inference.generate import load_for_generation
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.train.trainer import Trainer
    from tiny_run import tiny_raw

    mode, model_dir, run_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "train":
        raw = tiny_raw(
            run_dir,
            run_dir.parent / "corpus.txt",
            steps=1,
            global_batch=4,
            micro_batch=4,
            seq_len=16,
            save_every=-1,
            eval_every=0,
        )
        del raw["model"]
        raw["train"]["init_from"] = model_dir
        raw["parallel"] = {"ep": 4}
        config = config_from_dict(raw, init_source=init_source)
    # The process group first: its buffers are not the model's.
    mesh = init_mesh(ParallelDims(tp=4) if mode == "generate" else ParallelDims(ep=4))
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    baseline = resident("VmRSS")
    if mode == "train":
        trainer = Trainer(config, io.StringIO())
        rank = trainer.mesh.rank("ep")
        setup = resident("VmHWM") - baseline
        trainer.train_step()
    else:
        model, _ = load_for_generation(model_dir, device="cpu", mesh=mesh)
        rank = mesh.rank("tp")
        setup = resident("VmHWM") - baseline
    row = {"rank": rank, "setup": setup, "total": resident("VmHWM") - baseline}
    (run_dir.parent / f"{mode}-rank{rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
