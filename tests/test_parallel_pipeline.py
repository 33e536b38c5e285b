"""Pipeline parallelism (DualPipeV and 1F1B) on CPU processes (gloo), fp32, against one process
with the same global batch and the same 8 micro-batches:

- every gradient after one step's forwards and backwards (gathered whole from the stages and
  shards), and the step's loss and load-balancing loss, for PP 2 × EP 2, PP 2 × TP 2, PP 2 × 2
  data-parallel replicas, PP 2 × dp_shard 2 and PP 4 (8 DualPipeV stages, some holding only the
  embedding or head);
- 5 optimizer steps of the trainer (losses, aux losses, gradient norms: the clipping norm sums
  parts over the pipeline ranks) for PP 2 × EP 2 in both schedules, PP 2 × TP 2, PP 2 × dp_shard 2,
  and PP 2 alone through `torchrun ... moemesh train`; their checkpoints load whole;
- under FSDP, one gradient reduce-scatter per unit per step, not one per micro-batch;
- PP 2 × EP 2 with DualPipeV's overlapped FB ops (`parallel.pp_overlap`, on in the runs above): the
  forward chunk computes while the backward chunk's all-to-all is in flight and vice versa, and the
  step's gradients are bitwise those of the same FB ops run one chunk after the other.

Tolerance 1e-5 relative: the same fp32 terms summed in another order."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moemesh.checkpoint.load import load_model
from moemesh.config import config_from_dict
from moemesh.errors import ConfigError
from moemesh.parallel import comm
from moemesh.parallel.data import reduce_gradients
from moemesh.parallel.stored import stored_state
from moemesh.train.trainer import Trainer
from numerics import rel_err
from test_parallel_fsdp import assert_records_match, presented, train_steps
from test_parallel_train import metrics, torchrun
from tiny_run import tiny_raw, write_corpus, write_tiny_toml

WORLD = 4
RTOL = 1e-5
STEPS = 5
MODEL = {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 3, "mlp_only_layers": [0]}
TRAIN = {"steps": STEPS, "global_batch": 16, "micro_batch": 2, "eval_every": 0, "save_every": 0}  # 8 micro-batches
LAYOUTS = {
    "pp2-ep2": dict(pp=2, ep=2, pp_overlap=True),
    "pp2-tp2": dict(pp=2, tp=2),
    "pp2-dp2": dict(pp=2, dp_replicate=2),
    "pp2-dp_shard2": dict(pp=2, dp_shard=2),
    "pp4": dict(pp=4),
    "pp2-ep2-1f1b": dict(pp=2, ep=2, pp_schedule="1f1b"),
    "ep2-tp2-paired": dict(ep=2, tp=2, pp_overlap=True),  # no pipeline: F(m+1) overlaps B(m) (`schedule.paired`)
}


def run_config(directory, layout: dict, name: str) -> dict:
    raw = tiny_raw(directory / name, directory / "corpus.txt", **TRAIN)
    raw["model"].update(MODEL)
    raw["parallel"] = layout
    return raw


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the gradients of step 1 (before its optimizer step), then the records of steps 1..STEPS."""
    directory = tmp_path_factory.mktemp("pipeline")
    write_corpus(directory)
    trainer = Trainer(config_from_dict(run_config(directory, {}, "single")), io.StringIO())
    batch = trainer.dataset.train_sequences(0, trainer.train_config.global_batch)
    ce, aux = trainer._forward_backward(batch.split(trainer.train_config.micro_batch))
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    records = [trainer.train_step() for _ in range(STEPS)]
    return directory, (ce.item(), aux.item(), grads), records, trainer.model.state_dict()


def first_step_gradients(rank, raw: dict):
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    batch = trainer.dataset.train_sequences(0, trainer.train_config.global_batch)
    ce, aux = trainer.forward_backward(batch.split(trainer.train_config.micro_batch))
    reduce_gradients(trainer.model, trainer.mesh)
    comm.all_reduce_sum_([ce], trainer.mesh.group("batch"))
    grads = stored_state(
        {"model": {n: p.grad for n, p in trainer.model.named_parameters()}}, trainer.model, trainer.mesh
    )["model"]
    grads = {key: g.full_tensor() if isinstance(g, DTensor) else g for key, g in grads.items()}
    return ce.item(), aux.item(), grads


@pytest.mark.parametrize("layout", ["pp2-ep2", "pp2-tp2", "pp2-dp2", "pp2-dp_shard2", "pp4", "ep2-tp2-paired"])
def test_pipeline_gradients_equal_one_process(pool, reference, layout):
    directory, (ref_ce, ref_aux, ref_grads), _, _ = reference
    results = pool.run(first_step_gradients, run_config(directory, LAYOUTS[layout], layout))
    gathered = {}
    for ce, aux, grads in results:
        assert abs(ce - ref_ce) <= RTOL * ref_ce and abs(aux - ref_aux) <= RTOL * ref_aux, (ce, ref_ce, aux, ref_aux)
        gathered.update(grads)
    expected = {}
    for name, grad in ref_grads.items():
        expected.update(presented(name, grad))
    assert gathered.keys() == expected.keys()  # every parameter on some stage, none twice
    for name, grad in gathered.items():
        assert rel_err(grad, expected[name]) <= RTOL, name


def count_reduce_scatters(rank, raw: dict) -> tuple[int, int]:
    """(FSDP reduce-scatters in one step's forwards and backwards, FSDP units on this rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    trainer = Trainer(config_from_dict(raw), io.StringIO())
    batch = trainer.dataset.train_sequences(0, trainer.train_config.global_batch)
    calls = []
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    for n in names:  # FSDP calls whichever its torch version has, through the module attribute
        setattr(dist, n, lambda *a, _f=originals[n], **k: (calls.append(1), _f(*a, **k))[1])
    try:
        trainer.forward_backward(batch.split(trainer.train_config.micro_batch))
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)

    def has_own_parameters(unit) -> bool:  # rank 1's root holds none: no embedding, no head
        nested = {
            id(p)
            for child in unit.modules()
            if child is not unit and isinstance(child, FSDPModule)
            for p in child.parameters()
        }
        return any(id(p) not in nested for p in unit.parameters())

    units = [m for m in trainer.pipeline.module.modules() if isinstance(m, FSDPModule)]
    return len(calls), sum(has_own_parameters(unit) for unit in units)


def test_pipeline_fsdp_reduces_each_unit_once_per_step(pool, reference):
    """8 micro-batches, but each FSDP unit (block, expert bank, root) reduce-scatters its
    gradients once: in its stage's last backward."""
    directory = reference[0]
    for calls, units in pool.run(count_reduce_scatters, run_config(directory, LAYOUTS["pp2-dp_shard2"], "rs")):
        assert calls == units > 0


def assert_same_weights(run_dir, weights) -> None:
    model, _ = load_model(run_dir)
    for name, tensor in model.state_dict().items():
        assert rel_err(tensor, weights[name]) <= RTOL, name


@pytest.mark.parametrize("layout", ["pp2-ep2", "pp2-ep2-1f1b", "pp2-tp2", "pp2-dp_shard2"])
def test_pipeline_training_equals_one_process(pool, reference, layout):
    directory, _, records, weights = reference
    for rank_records in pool.run(train_steps, run_config(directory, LAYOUTS[layout], layout), STEPS):
        assert_records_match(rank_records, records)
    assert_same_weights(directory / layout, weights)


def test_torchrun_pp2_trains_like_one_process(reference):
    directory, _, records, weights = reference
    config_file = write_tiny_toml(directory)
    overrides = [f"model.{k}={v}".replace(" ", "") for k, v in MODEL.items()]
    overrides += [f"train.{k}={v}" for k, v in TRAIN.items()] + ["parallel.pp=2"]
    run_dir = directory / "torchrun-pp2"
    result = torchrun(
        2,
        "-m",
        "moemesh",
        "train",
        "--config",
        str(config_file),
        "--set",
        *overrides,
        f"train.run_dir={run_dir}",
        f"data.path={directory / 'corpus.txt'}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "layout  pp=2" in result.stdout
    assert_records_match([r for r in metrics(run_dir) if "loss" in r], records)
    assert_same_weights(run_dir, weights)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "parallel.pp=2 train.global_batch=6 train.micro_batch=2",
            "parallel.pp_schedule = 'dualpipev' with parallel.pp=2 needs at least 4 micro-batches per step, got "
            "train.global_batch / train.micro_batch = 6 / 2 = 3",
        ),
        ("parallel.pp=2 parallel.pp_schedule=gpipe", "gpipe"),
    ],
)
def test_pipeline_config_errors(override, message):
    from moemesh.config import load_config

    with pytest.raises(ConfigError, match=None) as error:
        load_config(None, override.split())
    assert message in str(error.value)


def traced_step(rank, raw: dict, overlap: bool):
    """One step's forwards and backwards with the FB ops' chunks overlapped or not: (ce, aux, this rank's
    gradients, the FB ops' pieces in order). A piece is ("launch" | "wait", "forward" | "backward")
    of an all-to-all of tokens, or ("compute", "forward" | "backward") when a decoder layer's
    attention or experts start their forward or backward; ("FB", op index) opens each FB op."""
    # A buffer with room for every (token, expert) pair: no step is computed again, one run is traced.
    parallel = {**raw["parallel"], "pp_overlap": True, "ep_capacity": float(raw["parallel"]["ep"])}
    trainer = Trainer(config_from_dict({**raw, "parallel": parallel}), io.StringIO())
    runner = trainer.pipeline
    runner.overlap = overlap  # the same schedule, its FB ops' chunks one after the other or not
    batch = trainer.dataset.train_sequences(0, trainer.train_config.global_batch)
    micro = [trainer._micro_batch(m) for m in batch.split(trainer.train_config.micro_batch)]
    pieces, in_fb, phase = [], [False], [None]

    class Work:  # the all-to-all's handle, noting when it is waited for
        def __init__(self, work, direction):
            self.work, self.direction = work, direction

        def wait(self):
            if in_fb[0]:
                pieces.append(("wait", self.direction))
            return self.work.wait()

    def traced(collective):  # the dispatcher's all-gather and all-to-all of tokens
        def launch(out, packed, *args, async_op=False, **kwargs):
            work = collective(out, packed, *args, async_op=async_op, **kwargs)
            if packed.dtype != torch.uint8:  # the split sizes' exchange
                return work
            if in_fb[0]:
                pieces.append(("launch", phase[0]))
            return Work(work, phase[0])

        return launch

    def count(kind, direction, nbytes):
        phase[0] = direction
        originals[2](kind, direction, nbytes)

    def traced_op(method):
        def run(op, op_index):
            in_fb[0] = True
            pieces.append(("FB", op_index))
            method(op, op_index)
            in_fb[0] = False

        return run

    def starts(direction):
        def hook(module, args):
            if in_fb[0]:
                pieces.append(("compute", direction))

        return hook

    for i in sorted(i for stage in runner.stages.values() for i in stage.layers):
        layer = trainer.model.model.layers[i]
        for module in (layer.self_attn, getattr(layer.mlp, "experts", None)):
            if module is not None:
                module.register_forward_pre_hook(starts("forward"))
                module.register_full_backward_pre_hook(starts("backward"))
    originals = dist.all_to_all_single, dist.all_gather_into_tensor, comm._count
    dist.all_to_all_single, dist.all_gather_into_tensor = traced(originals[0]), traced(originals[1])
    comm._count = count
    if overlap:
        runner._forward_backward = traced_op(runner._forward_backward)
    else:  # every op, all of them sequential
        in_fb[0] = True
    try:
        ce, aux = runner.train(micro)
    finally:
        dist.all_to_all_single, dist.all_gather_into_tensor, comm._count = originals
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    return ce.item(), aux.item(), grads, pieces


@pytest.mark.parametrize("layout", ["pp2-ep2", "ep2-tp2-paired"])
def test_pipeline_overlap_interleaves_chunks_exactly(pool, reference, layout):
    """PP 2 × EP 2 under DualPipeV, and EP 2 × TP 2 without a pipeline (paired forwards and backwards),
    8 micro-batches: in each overlapped FB op, the forward chunk's compute runs between a backward
    all-to-all's launch and its wait, and the backward runs on while a forward all-to-all is in
    flight; the gradients, loss and load-balancing loss are exactly those of the same step with
    each FB op's chunks run one after the other."""
    raw = run_config(reference[0], LAYOUTS[layout], f"overlap-{layout}")
    sequential = pool.run(traced_step, raw, False)
    overlapped = pool.run(traced_step, raw, True)
    for (ce, aux, grads, pieces), (ce_o, aux_o, grads_o, pieces_o) in zip(sequential, overlapped):
        assert (ce, aux) == (ce_o, aux_o)
        assert grads.keys() == grads_o.keys()
        assert all(torch.equal(grads[name], grads_o[name]) for name in grads)
        # One chunk after the other: every all-to-all is waited for right after its launch.
        assert ("launch", "backward") in pieces
        assert all(b == ("wait", a[1]) for a, b in zip(pieces, pieces[1:]) if a[0] == "launch")
        ops = _split_ops(pieces_o)
        assert len(ops) >= 4
        for pieces_of_op in ops:
            flights = _in_flight(pieces_of_op)
            # While one chunk's all-to-alls are in flight, the other chunk computes, in every FB op
            # (a stage without MoE layers has none: the other chunk's then hide it all).
            for direction, other in (("forward", "backward"), ("backward", "forward")):
                if any(d == direction for d, _ in flights):
                    assert any(("compute", other) in inside for d, inside in flights if d == direction)
            # And the two interleave, when both have all-to-alls: the backward launches its next
            # all-to-all while the forward's is in flight.
            if {d for d, _ in flights} == {"forward", "backward"}:
                assert any(("launch", "backward") in inside for d, inside in flights if d == "forward")


def _split_ops(pieces: list) -> list[list]:
    ops = []
    for piece in pieces:
        if piece[0] == "FB":
            ops.append([])
        else:
            ops[-1].append(piece)
    return ops


def _in_flight(pieces: list) -> list[tuple[str, list]]:
    """(direction, the pieces between launch and wait) of each all-to-all of one FB op."""
    flights = []
    for i, (kind, direction) in enumerate(pieces):
        if kind == "launch":
            end = pieces.index(("wait", direction), i + 1)
            flights.append((direction, pieces[i + 1 : end]))
    return flights


def checkpointing_changes_nothing(rank, raw: dict, mode: str) -> bool:
    """One step's forwards and backwards of a pipeline layout with and without activation
    checkpointing: the same loss, load-balancing loss and gradients on this rank, bit for bit."""
    results = []
    for checkpointing in ("none", mode):
        config = config_from_dict({**raw, "train": {**raw["train"], "activation_checkpointing": checkpointing}})
        trainer = Trainer(config, io.StringIO())
        batch = trainer.dataset.train_sequences(0, trainer.train_config.global_batch)
        ce, aux = trainer.forward_backward(batch.split(trainer.train_config.micro_batch))
        grads = {
            name: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for name, p in trainer.model.named_parameters()
        }
        results.append((ce, aux, grads))
    (ce, aux, grads), (ce_ac, aux_ac, grads_ac) = results
    assert torch.equal(ce, ce_ac) and torch.equal(aux, aux_ac)
    assert grads.keys() == grads_ac.keys()
    return all(torch.equal(grads[name], grads_ac[name]) for name in grads)


@pytest.mark.parametrize(
    "layout, mode",
    [("pp2-ep2", "full"), ("pp2-ep2", "selective"), ("pp2-dp_shard2", "full"), ("pp2-dp_shard2", "selective")],
)
def test_activation_checkpointing_in_pipeline_stages(pool, reference, layout, mode):
    """DualPipeV's stages checkpoint their layers: under EP with overlapped FB ops and deferred
    weight gradients (W ops), and under FSDP (its units gather again for the recomputation)."""
    raw = run_config(reference[0], LAYOUTS[layout], f"ac-{layout}-{mode}")
    assert all(pool.run(checkpointing_changes_nothing, raw, mode))


@pytest.mark.parametrize("layout", ["pp2-ep2", "pp2-dp_shard2"])
def test_lora_in_pipeline_stages_equals_one_process(pool, reference, layout):
    """Each pipeline stage owns its layers' adapters (DualPipeV, under EP with overlapped FB ops and
    deferred weight gradients, and under FSDP): one step's loss and every adapter gradient equal one
    process's, and the frozen base gets none."""
    directory = reference[0]
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "layers.0.mlp.*_proj"]}
    single = Trainer(config_from_dict({**run_config(directory, {}, "lora-single"), "lora": lora}), io.StringIO())
    batch = single.dataset.train_sequences(0, single.train_config.global_batch)
    ref_ce, ref_aux = single._forward_backward(batch.split(single.train_config.micro_batch))
    expected = {}
    for name, param in single.model.named_parameters():
        if param.requires_grad:
            expected.update(presented(name, param.grad))
    raw = {**run_config(directory, LAYOUTS[layout], f"lora-{layout}"), "lora": lora}
    gathered = {}
    for ce, aux, grads in pool.run(first_step_gradients, raw):
        assert abs(ce - ref_ce.item()) <= RTOL * ref_ce.item() and abs(aux - ref_aux.item()) <= RTOL * ref_aux.item()
        gathered.update({key: grad for key, grad in grads.items() if grad is not None})
    assert gathered.keys() == expected.keys()
    for key, grad in gathered.items():
        assert rel_err(grad, expected[key]) <= RTOL, key
