"""FSDP (dp_shard), alone and with EP, TP and a replicate axis (HSDP), on 4 CPU processes (gloo),
fp32, against one process:

- one forward/backward: loss, aux loss and every gradient (gathered whole from the shards as a
  checkpoint presents them) at 1e-5 relative, and the bytes each rank stores for parameters,
  gradients and AdamW moments: exactly its shards, ≈ the whole model's / the shard count;
- the trainer: 5 optimizer steps (micro-batches, clipping, AdamW on the shards) give the losses and
  gradient norms of one process at 1e-5; the sharded checkpoint loads whole into one process, equal
  to the layout's own weights, and a run of another layout resumes from it and takes the
  reference's step 6.

Tolerance 1e-5: the same fp32 terms summed in another order (reduce-scatter instead of one sum)."""

import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from moemesh.checkpoint.load import load_model
from moemesh.config import config_from_dict
from moemesh.models import ModelConfig
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel, label_tokens, local, rank_loss, reduce_gradients
from moemesh.parallel.expert import apply_ep, is_expert_parameter
from moemesh.parallel.fsdp import apply_fsdp, shard_dim
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.stored import HALVES, packed_dim, stored_state
from moemesh.parallel.tensor import apply_tp
from moemesh.train.trainer import Trainer
from numerics import rel_err
from test_parallel_tensor import QWEN3, build_with_biases, micro_batch
from tiny_run import tiny_raw, write_corpus

WORLD = 4
RTOL = 1e-5
LAYOUTS = {
    "dp_shard4": dict(dp_shard=4),
    "dp_shard2-tp2": dict(dp_shard=2, tp=2),
    "dp_shard2-ep2": dict(dp_shard=2, ep=2),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
}


def whole(state: dict) -> dict:
    """Gather every DTensor of a presented state whole (a collective over its ranks)."""
    return {key: t.full_tensor() if isinstance(t, DTensor) else t for key, t in state.items()}


def presented(name: str, tensor: torch.Tensor) -> dict:
    """A whole tensor under the keys a checkpoint stores it by."""
    if (dim := packed_dim(name)) is not None:
        return {f"{name}.{half}": part for half, part in zip(HALVES, tensor.chunk(2, dim=dim))}
    return {name: tensor}


def check_gradients_and_bytes(rank, config: ModelConfig, layout: dict):
    dims = ParallelDims(**layout)
    input_ids, labels = micro_batch(seed=sum(layout.values()), batch=2 * dims.batch_size)
    reference = build_with_biases(config)
    ref_out = reference(input_ids, labels=labels)
    ref_out.loss.backward()

    mesh = init_mesh(dims)
    model = apply_data_parallel(apply_tp(apply_ep(build_with_biases(config), mesh), mesh), mesh)
    kept_whole = apply_fsdp(model, mesh)
    rows = input_ids.shape[0] // dims.batch_size
    part = slice(mesh.rank("batch") * rows, (mesh.rank("batch") + 1) * rows)
    out = model(input_ids[part], labels=labels[part])
    loss = rank_loss(
        out.ce_loss,
        out.aux_loss,
        label_tokens(labels[part]),
        label_tokens(labels),
        config.router_aux_loss_coef,
        dims.batch_size,
    )
    loss.backward()
    reduce_gradients(model, mesh)
    comm.all_reduce_sum_([summed := loss.detach().clone()], mesh.group("batch"))
    assert rel_err(summed, ref_out.loss.detach()) <= RTOL
    assert rel_err(out.aux_loss, ref_out.aux_loss) <= RTOL

    grads = whole(stored_state({"model": {n: p.grad for n, p in model.named_parameters()}}, model, mesh)["model"])
    expected = {}
    for name, param in reference.named_parameters():
        expected.update(presented(name, param.grad))
    assert grads.keys() == expected.keys()
    for key, grad in grads.items():
        assert grad.shape == expected[key].shape, key
        assert rel_err(grad, expected[key]) <= RTOL, key

    # Storage: parameters, gradients and both AdamW moments, this rank's shards only.
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    stored = 0
    for param in model.parameters():
        moments = optimizer.state[param]
        stored += sum(local(t).numel() * 4 for t in (param, param.grad, moments["exp_avg"], moments["exp_avg_sq"]))
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):  # an even FSDP split of this rank's EP/TP piece (the DTensor's shape)
            parts = dims.dp_shard * (1 if is_expert_parameter(name) else dims.ep)
            assert param.placements[-1].dim == shard_dim(name, param, dims), name
            assert local(param).numel() * parts == param.numel(), name
    # gradients and moments are sharded like their parameters
    assert stored == 4 * 4 * sum(local(p).numel() for p in model.parameters())
    total = 4 * 4 * sum(p.numel() for p in reference.parameters())
    degree = dims.dp_shard * dims.ep * dims.tp
    assert abs(stored - total / degree) <= 0.1 * total / degree, (stored, total / degree)
    return kept_whole


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_fsdp_gradients_and_storage_equal_one_process(pool, layout):
    kept_whole = pool.run(check_gradients_and_bytes, QWEN3, layout)[0]
    if layout.get("tp", 1) > 1:  # the q/k/v biases are split over tp on their only dimension
        assert kept_whole == [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(3) for p in "qkv"]
    else:
        assert kept_whole == []


def test_fsdp_shards_copied_key_value_heads(pool):
    """One key/value head over TP 2 × dp_shard 2: each TP rank keeps a copy, FSDP shards it, and the
    gradients, summed over the dp_shard ranks and then over the copies, are one process's."""
    pool.run(check_gradients_and_bytes, QWEN3.replace(num_key_value_heads=1), LAYOUTS["dp_shard2-tp2"])


# ---- the trainer -----------------------------------------------------------------------------------

STEPS = 5


def train_steps(rank, raw: dict, steps: int, restore: str | None = None) -> list[dict]:
    """`steps` trainer steps in the layout raw["parallel"] (after restoring `restore`), then a checkpoint."""
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    if restore is not None:
        trainer.restore(Path(restore))
    records = [trainer.train_step() for _ in range(steps)]
    trainer.save()
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the records of steps 1..STEPS+1."""
    directory = tmp_path_factory.mktemp("fsdp")
    raw = tiny_raw(directory / "single", write_corpus(directory), global_batch=8, micro_batch=4)
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    return raw, [trainer.train_step() for _ in range(STEPS + 1)]


def assert_records_match(ours: list[dict], theirs: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (step, key, a[key], b[key])
        # Whole-number expert loads summed exactly over the ranks: the same routing, the same statistics.
        loads = {key: value for key, value in b.items() if key.startswith("expert_load")}
        assert loads and {key: value for key, value in a.items() if key.startswith("expert_load")} == loads, step


def train_and_gather(rank, raw: dict, steps: int) -> tuple[list[dict], dict]:
    """`train_steps`, and this layout's weights after them, gathered whole as a checkpoint stores them."""
    records = train_steps(rank, raw, steps)
    trainer = Trainer(
        config_from_dict({**raw, "train": {**raw["train"], "run_dir": raw["train"]["run_dir"] + "-b"}}), io.StringIO()
    )
    trainer.restore(Path(raw["train"]["run_dir"]) / "checkpoints" / f"step_{steps}")
    gathered = whole(
        stored_state({"model": dict(trainer.model.named_parameters())}, trainer.model, trainer.mesh)["model"]
    )
    return records, {key: tensor.detach() for key, tensor in gathered.items()}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_fsdp_training_equals_one_process(pool, reference, tmp_path, layout):
    """Five steps give one process's losses and gradient norms; the weights are compared exactly
    against the layout's own (5 free-running steps can part from one process's by a top-k flip:
    the same step is compared exactly in test_parallel_horizon.py), loaded whole from its sharded
    checkpoint into one process."""
    raw, records = reference
    raw = {**raw, "parallel": layout, "train": {**raw["train"], "run_dir": str(tmp_path)}}
    ours = pool.run(train_and_gather, raw, STEPS)
    for rank_records, _ in ours:  # the same figures on every rank
        assert_records_match(rank_records, records[:STEPS])
    model, _ = load_model(tmp_path)
    loaded = {}
    for name, tensor in model.named_parameters():
        loaded.update(presented(name, tensor.detach()))
    gathered = ours[0][1]
    assert loaded.keys() == gathered.keys()
    for key, tensor in gathered.items():
        assert torch.equal(loaded[key], tensor.detach()), key


def test_resume_in_another_layout(pool, reference, tmp_path):
    """dp_shard 4 saves step 5; dp_shard 2 × TP 2 resumes from it, and so does one process: both
    take the reference's step 6 (the sharded optimizer state came back into other shards)."""
    raw, records = reference
    raw = {**raw, "train": {**raw["train"], "run_dir": str(tmp_path / "a")}}
    pool.run(train_steps, {**raw, "parallel": LAYOUTS["dp_shard4"]}, STEPS)
    saved = str(tmp_path / "a" / "checkpoints" / f"step_{STEPS}")
    raw_b = {**raw, "parallel": LAYOUTS["dp_shard2-tp2"], "train": {**raw["train"], "run_dir": str(tmp_path / "b")}}
    for rank_records in pool.run(train_steps, raw_b, 1, saved):
        assert_records_match(rank_records, records[STEPS:])
    single = Trainer(
        config_from_dict({**raw, "train": {**raw["train"], "run_dir": str(tmp_path / "c")}}), io.StringIO()
    )
    single.restore(Path(saved))
    assert_records_match([single.train_step()], records[STEPS:])


def test_copied_key_value_heads_train_save_and_resume(pool, reference, tmp_path):
    """The tiny model's 2 key/value heads under TP 4: each rank keeps a copy of one. Five trainer
    steps give one process's losses and gradient norms (each copy's gradient summed over its
    copies, counted once in the norm); the checkpoint, each head written once, loads whole into one
    process equal to the layout's own weights, and one process resumes from it with the
    reference's step 6. The other way, TP 4 resumes from one process's step-5 checkpoint and takes
    step 6 too (weights and AdamW moments read into each copy)."""
    raw, records = reference
    tp4 = {**raw, "parallel": {"tp": 4}, "train": {**raw["train"], "run_dir": str(tmp_path / "a")}}
    ours = pool.run(train_and_gather, tp4, STEPS)
    for rank_records, _ in ours:
        assert_records_match(rank_records, records[:STEPS])
    model, _ = load_model(tmp_path / "a")
    loaded = {}
    for name, tensor in model.named_parameters():
        loaded.update(presented(name, tensor.detach()))
    assert loaded.keys() == ours[0][1].keys()
    for key, tensor in ours[0][1].items():
        assert torch.equal(loaded[key], tensor), key
    metadata = dcp.FileSystemReader(tmp_path / "a" / "checkpoints" / f"step_{STEPS}").read_metadata()
    for key, stored in metadata.state_dict_metadata.items():  # no part written twice: the chunks tile it
        if hasattr(stored, "chunks"):
            assert sum(math.prod(chunk.sizes) for chunk in stored.chunks) == math.prod(stored.size), key
    k_proj = metadata.state_dict_metadata["model.model.layers.0.self_attn.k_proj.weight"]
    assert len(k_proj.chunks) == 2  # one per head, of 4 ranks

    one_process = {**raw, "train": {**raw["train"], "run_dir": str(tmp_path / "b")}}
    single = Trainer(config_from_dict(one_process), io.StringIO())
    single.restore(tmp_path / "a" / "checkpoints" / f"step_{STEPS}")
    assert_records_match([single.train_step()], records[STEPS:])

    train_steps(0, {**raw, "train": {**raw["train"], "run_dir": str(tmp_path / "c")}}, STEPS)  # one process
    saved = str(tmp_path / "c" / "checkpoints" / f"step_{STEPS}")
    tp4 = {**tp4, "train": {**raw["train"], "run_dir": str(tmp_path / "d")}}
    for rank_records in pool.run(train_steps, tp4, 1, saved):
        assert_records_match(rank_records, records[STEPS:])


# ---- LoRA ------------------------------------------------------------------------------------------


def check_lora_gradients(rank, layout: dict):
    """FSDP shards the adapters with their base (and holds no gradient or moment for the frozen
    base): every adapter gradient, gathered whole, equals one process's."""
    from moemesh.models.lora import LoraConfig
    from test_lora import QWEN3_TARGETS, lora_model

    lora = LoraConfig(rank=4, alpha=8.0, targets=QWEN3_TARGETS)
    dims = ParallelDims(**layout)
    input_ids, labels = micro_batch(seed=3, batch=2 * dims.batch_size)
    reference = lora_model(QWEN3, lora)
    reference(input_ids, labels=labels).loss.backward()

    mesh = init_mesh(dims)
    model = apply_data_parallel(apply_tp(apply_ep(lora_model(QWEN3, lora), mesh), mesh), mesh)
    apply_fsdp(model, mesh)
    rows = input_ids.shape[0] // dims.batch_size
    part = slice(mesh.rank("batch") * rows, (mesh.rank("batch") + 1) * rows)
    out = model(input_ids[part], labels=labels[part])
    loss = rank_loss(
        out.ce_loss,
        out.aux_loss,
        label_tokens(labels[part]),
        label_tokens(labels),
        QWEN3.router_aux_loss_coef,
        dims.batch_size,
    )
    loss.backward()
    reduce_gradients(model, mesh)
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert any(isinstance(p, DTensor) for n, p in model.named_parameters() if n in trained)  # sharded by FSDP
    grads = whole(stored_state({"model": trained}, model, mesh)["model"])
    expected = {}
    for name, param in reference.named_parameters():
        if param.requires_grad:
            expected.update(presented(name, param.grad))
    assert grads.keys() == expected.keys()
    for key, grad in grads.items():
        assert rel_err(grad, expected[key]) <= RTOL, key
    return True


@pytest.mark.parametrize("layout", ["dp_shard4", "dp_shard2-tp2", "dp_shard2-ep2"])
def test_fsdp_lora_gradients_equal_one_process(pool, layout):
    assert all(pool.run(check_lora_gradients, LAYOUTS[layout]))


def test_lora_run_resumes_in_another_layout(pool, tmp_path):
    """A LoRA run (base from the seed, frozen) under FSDP × EP saves its adapters and their
    sharded AdamW state after 3 steps; FSDP × TP resumes from that checkpoint and takes one
    process's step 4. The checkpoint holds no base weight."""
    from moemesh.models.lora import is_adapter

    raw = tiny_raw(tmp_path / "single", write_corpus(tmp_path), global_batch=8, micro_batch=4)
    raw["lora"] = {"rank": 4, "alpha": 8.0}
    single = Trainer(config_from_dict(raw), io.StringIO())
    records = [single.train_step() for _ in range(4)]
    raw_a = {**raw, "parallel": LAYOUTS["dp_shard2-ep2"], "train": {**raw["train"], "run_dir": str(tmp_path / "a")}}
    for rank_records in pool.run(train_steps, raw_a, 3):
        assert_records_match(rank_records, records[:3])
    saved = tmp_path / "a" / "checkpoints" / "step_3"
    stored = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert all(
        is_adapter(key.split(".", 1)[1].removesuffix(".gate").removesuffix(".up"))
        for key in stored
        if key.startswith("model.")
    )
    raw_b = {**raw, "parallel": LAYOUTS["dp_shard2-tp2"], "train": {**raw["train"], "run_dir": str(tmp_path / "b")}}
    for rank_records in pool.run(train_steps, raw_b, 1, str(saved)):
        assert_records_match(rank_records, records[3:])
