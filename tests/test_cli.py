"""The `moemesh` command: one clear line and exit code 2 for each user mistake; generate and
convert on a trained checkpoint."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moemesh.checkpoint.load import from_pretrained, load_model
from moemesh.cli import INFERENCE_ALLOCATOR, inference_allocator, main
from moemesh.train.trainer import train
from tiny_run import tiny_config, write_corpus, write_tiny_toml


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run directory of a tiny model trained for 20 steps."""
    directory = tmp_path_factory.mktemp("trained")
    train(tiny_config(directory / "run", write_corpus(directory)), stream=io.StringIO())
    return directory / "run"


def _fails(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own checks
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
        ("model.num_experts_per_tok=5", "num_experts_per_tok (5) must be <= num_experts (4)"),
        ("train.global_batch=5", "train.global_batch (5) must be divisible by train.micro_batch (2)"),
        ("parallel.pp=2", "parallel.pp_schedule = 'dualpipev' with parallel.pp=2 needs at least 4 micro-batches"),
    ],
)
def test_config_mistakes(tmp_path, capsys, override, message):
    err = _fails(capsys, ["train", "--config", str(write_tiny_toml(tmp_path)), "--set", override])
    assert err.startswith("moemesh train: error: ") and message in err


def test_missing_and_corrupt_data(tmp_path, capsys):
    config = str(write_tiny_toml(tmp_path))
    err = _fails(capsys, ["train", "--config", config, "--set", f"data.path={tmp_path / 'gone.txt'}"])
    assert f"data file not found: {tmp_path / 'gone.txt'}" in err
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    err = _fails(capsys, ["train", "--config", config, "--set", f"data.path={tmp_path / 'bad.npy'}"])
    assert f"cannot read token file {tmp_path / 'bad.npy'}" in err


def test_missing_and_incomplete_checkpoints(tmp_path, capsys, trained):
    err = _fails(capsys, ["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"])
    assert f"checkpoint not found: {tmp_path / 'nothing'}" in err

    broken = tmp_path / "broken"
    shutil.copytree(trained / "checkpoints" / "step_20", broken)
    (broken / ".metadata").rename(tmp_path / "metadata")
    err = _fails(capsys, ["generate", "--checkpoint", str(broken), "--prompt", "x"])
    assert f"{broken} is not a complete checkpoint (no .metadata)" in err

    (tmp_path / "metadata").rename(broken / ".metadata")
    data_file = max(broken.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[:1000])
    err = _fails(capsys, ["convert", str(broken), str(tmp_path / "hf")])
    assert f"{broken} is not a complete checkpoint ({data_file.name} is missing or truncated)" in err

    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    err = _fails(capsys, ["generate", "--checkpoint", str(tmp_path / "empty_run"), "--prompt", "x"])
    assert "no complete checkpoint in" in err


def test_resume_into_a_different_model_is_refused(tmp_path, capsys, trained):
    config = write_tiny_toml(tmp_path)
    shutil.copytree(trained, tmp_path / "run")
    err = _fails(capsys, ["train", "--config", str(config), "--set", "train.resume=true", "model.hidden_size=64"])
    assert "cannot load checkpoint" in err and "step_20" in err


def test_the_command_line_exits_2_without_a_traceback(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}  # works installed or not
    result = subprocess.run(
        [sys.executable, "-m", "moemesh", "train", "--set", "train.step=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr == "moemesh train: error: unknown config key 'train.step' (did you mean 'train.steps'?)\n"


def test_generate_prints_the_prompt_and_its_continuation(capsys, trained, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert main(["generate", "--checkpoint", str(trained), "--prompt", "def ", "--max-new-tokens", "30"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == INFERENCE_ALLOCATOR  # the inference commands' default
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > len("def \n")
    args = ["generate", "--checkpoint", str(trained), "--prompt", "x", "--temperature", "0.9", "--top-p", "0.9"]
    main(args + ["--seed", "1"])
    first = capsys.readouterr().out
    main(args + ["--seed", "1"])
    assert capsys.readouterr().out == first  # seeded sampling repeats


def test_generate_many_prompts_from_a_file(tmp_path, capsys, trained):
    checkpoint = ["generate", "--checkpoint", str(trained)]
    (tmp_path / "p.jsonl").write_text('{"prompt": "def "}\n{"prompt": "class ", "max_tokens": 5, "stop": ["\\n"]}\n')
    assert main([*checkpoint, "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "20"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["def ", "class "]
    assert lines[1]["completion_tokens"] <= 5 and "\n" not in lines[1]["text"]
    assert lines[0]["prompt_tokens"] == len("def ") + 1  # after the end-of-document token
    assert main([*checkpoint, "--prompt", "def ", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == "def " + lines[0]["text"] + "\n"  # batched: the text of the prompt alone
    # a cache of 7 blocks of 4 (28 entries: the 25 of the first request fit, not both requests whole)
    # and 3 tokens a step (prompts prefilled in chunks): the same texts
    small = ["--kv-blocks", "8", "--block-size", "4", "--max-num-batched-tokens", "3", "--no-prefix-caching"]
    assert main([*checkpoint, "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "20", *small]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines

    (tmp_path / "p.txt").write_text("def \nclass \n")
    assert (
        main(
            [
                *checkpoint,
                "--prompts-file",
                str(tmp_path / "p.txt"),
                "--max-new-tokens",
                "20",
                "--output",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert written[0] == lines[0] and written[1]["prompt"] == "class "


def test_every_line_of_a_prompts_file_is_a_row(tmp_path, capsys, trained):
    """3 lines in, 3 rows out, in order: an empty line and a line of spaces are prompts as written
    (the empty one continues the end-of-document token alone, as `--prompt ""` does); a line that
    cannot run is named by its number. `--help` says so."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "every line as written (an empty line is an empty prompt" in " ".join(capsys.readouterr().out.split())
    (tmp_path / "p.txt").write_text("def \n\n    \n")
    args = ["generate", "--checkpoint", str(trained), "--max-new-tokens", "8"]
    assert main([*args, "--prompts-file", str(tmp_path / "p.txt")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["prompt"] for row in rows] == ["def ", "", "    "]
    assert [row["prompt_tokens"] for row in rows] == [5, 1, 5]
    assert main([*args, "--prompt", ""]) == 0
    assert capsys.readouterr().out == rows[1]["text"] + "\n"

    (tmp_path / "long.txt").write_text("def \n" + "x" * 200 + "\n")
    err = _fails(capsys, [*args, "--prompts-file", str(tmp_path / "long.txt")])
    assert err == (
        f"moemesh generate: error: --prompts-file {tmp_path / 'long.txt'} line 2: the prompt has 201 tokens; the "
        "context holds 128 (the prompt and at least one new token)\n"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
        (["--packed-graph-tokens", "-1"], "--packed-graph-tokens must be >= 0, got -1"),
        (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction must be in (0, 1], got 1.5"),
        (["--kv-blocks", "1"], "--kv-blocks must be >= 2, got 1"),
        (
            ["--kv-blocks", "3", "--max-len", "64"],
            "the KV cache holds 32 tokens (2 blocks of 16), fewer than one sequence of max_len=64: lower "
            "--max-len, or give the cache more room (--gpu-memory-fraction, --kv-blocks)",
        ),
        (["--device", "tpu"], "--device must be 'auto', 'cpu' or 'cuda[:N]', got 'tpu'"),
        (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
        (
            ["--prompt", "caf\udce9"],
            "--prompt: prompt is not UTF-8 text: the byte 0xe9 at character 3 is not valid UTF-8",
        ),
        (
            ["--prompt", "x" * 200],
            "--prompt: the prompt has 201 tokens; the context holds 128 (the prompt and at least one new token)",
        ),
        (
            ["--tokenizer", "gone.json"],
            "tokenizer file not found: gone.json (a tokenizer is 'bytes' or a tokenizer.json file)",
        ),
    ],
    ids=[
        "temperature-nan",
        "temperature-inf",
        "temperature-negative",
        "top-p-nan",
        "top-p-0",
        "max-new-tokens-0",
        "tp-0",
        "max-num-batched-tokens-0",
        "packed-graph-tokens-negative",
        "gpu-memory-fraction-1.5",
        "kv-blocks-1",
        "kv-blocks-too-few",
        "device-tpu",
        "temperature-word",
        "prompt-latin-1",
        "prompt-too-long",
        "tokenizer-missing",
    ],
)
def test_each_bad_generate_argument_is_named(capsys, trained, args, message):
    """One line naming the argument at fault (a non-UTF-8 prompt reaches Python as lone surrogates,
    as "caf\\xe9" in Latin-1 does here)."""
    err = _fails(capsys, ["generate", "--checkpoint", str(trained), "--prompt", "x", *args])
    assert err == f"moemesh generate: error: {message}\n"


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(tmp_path, capsys, trained):
    """generate and serve name a tokenizer with ids past the model's embedding before any weight is
    read (a prompt would fail later with only "token id 300 is not in [0, 256)")."""
    from tokenizers import Tokenizer, models

    big = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0")).save(str(big))
    err = _fails(capsys, ["generate", "--checkpoint", str(trained), "--prompt", "x", "--tokenizer", str(big)])
    assert err == (
        f"moemesh generate: error: the tokenizer {big} (--tokenizer) has 300 tokens, more than the model's "
        "vocab_size 256: its ids from 256 on have no embedding (name the model's own tokenizer with --tokenizer)\n"
    )
    hf = tmp_path / "hf"
    assert main(["convert", str(trained), str(hf)]) == 0
    shutil.copy(big, hf / "tokenizer.json")
    capsys.readouterr()
    err = _fails(capsys, ["generate", "--checkpoint", str(hf), "--prompt", "x"])
    assert f"the tokenizer {hf / 'tokenizer.json'} (the checkpoint's) has 300 tokens" in err
    if importlib.util.find_spec("fastapi") is not None:
        err = _fails(capsys, ["serve", "--checkpoint", str(hf), "--port", "0"])
        assert err.startswith("moemesh serve: error: the tokenizer ") and "has 300 tokens" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_generate_on_a_gpu_that_is_not_there(capsys, trained):
    err = _fails(capsys, ["generate", "--checkpoint", str(trained), "--prompt", "x", "--device", "cuda"])
    assert err == "moemesh generate: error: --device='cuda' but torch sees no GPU\n"


def test_generation_stops_at_the_models_last_position(capsys, trained):
    assert main(["generate", "--checkpoint", str(trained), "--prompt", "a" * 100, "--max-new-tokens", "200"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("a" * 100) and len(out) <= 100 + (128 - 101) + 1  # a character per byte token; "\n"
    new_tokens = len(out) - 101
    assert err == (
        f"moemesh generate: stopped at the model's position limit (128 tokens), prompt included: {new_tokens} of "
        "the 200 new tokens asked for\n"
    )
    assert main(["generate", "--checkpoint", str(trained), "--prompt", "a" * 100, "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().err == ""  # all 5 given


def test_serve_on_a_busy_port_is_one_line_before_loading(capsys, trained, monkeypatch):
    import socket

    pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")
    loads = []
    monkeypatch.setattr("moemesh.inference.generate.load_for_generation", lambda *args: loads.append(args))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _fails(capsys, ["serve", "--checkpoint", str(trained), "--port", str(port)])
    reason = "cannot listen there (in use by another process)"
    assert err == f"moemesh serve: error: --host 127.0.0.1 --port {port}: {reason}\n"
    err = _fails(capsys, ["serve", "--checkpoint", str(trained), "--reply-window-ms", "-1"])
    assert err == "moemesh serve: error: --reply-window-ms must be between 0 and 1000, got -1.0\n"
    assert loads == []


def test_serve_hands_its_schedule_reply_window_step_budget_and_overlap_to_the_scheduler(trained, monkeypatch):
    pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")
    schedulers = []
    monkeypatch.setattr(
        "moemesh.inference.server.Service.serve", lambda self, *a, **k: schedulers.append(self.scheduler)
    )
    argv = ["serve", "--checkpoint", str(trained), "--port", "0"]
    assert main(argv) == 0
    options = ["--schedule", "prefill-first", "--reply-window-ms", "5", "--max-num-batched-tokens", "64"]
    assert main([*argv, *options, "--no-overlap"]) == 0
    settings = [(s.prefill_first, s.reply_window_s, s.engine.max_num_batched_tokens, s.overlap) for s in schedulers]
    assert settings == [(False, 0.025, 1536, True), (True, 0.005, 64, False)]


def test_bad_estimate_and_convert_arguments(tmp_path, capsys, trained):
    assert _fails(capsys, ["estimate", "--pp", "0"]) == "moemesh estimate: error: --pp must be >= 1, got 0\n"
    assert (
        _fails(capsys, ["convert", str(trained)])
        == "moemesh convert: error: the following arguments are required: DST\n"
    )
    (tmp_path / "file").write_text("")
    assert (
        _fails(capsys, ["convert", str(trained), str(tmp_path / "file")])
        == f"moemesh convert: error: {tmp_path / 'file'} exists and is not a directory; choose a new directory\n"
    )
    assert (
        _fails(capsys, ["convert", str(trained), str(tmp_path / "file" / "hf")])
        == f"moemesh convert: error: cannot write {tmp_path / 'file' / 'hf'}: Not a directory\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-written


def test_convert_to_hugging_face_and_back(tmp_path, capsys, trained):
    original, _ = load_model(trained)
    tokens = torch.tensor([[0, 104, 101, 108, 108, 111]])
    expected = original(tokens).logits

    assert main(["convert", str(trained), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    torch.testing.assert_close(from_pretrained(tmp_path / "hf")(tokens).logits, expected, rtol=0, atol=0)

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, _ = load_model(tmp_path / "back")
    torch.testing.assert_close(back(tokens).logits, expected, rtol=0, atol=0)
    assert "wrote moemesh checkpoint" in capsys.readouterr().out

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    torch.testing.assert_close(theirs(tokens).logits, expected, rtol=1e-4, atol=1e-4)
    capsys.readouterr()  # drop transformers' progress output

    err = _fails(capsys, ["convert", str(trained), str(tmp_path / "hf")])
    assert "already exists and is not empty" in err


def test_convert_writes_bfloat16_on_request(tmp_path, trained):
    assert main(["convert", str(trained), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert from_pretrained(tmp_path / "hf").lm_head.weight.dtype == torch.bfloat16


def test_out_of_memory_is_one_line_with_advice(monkeypatch, capsys):
    """A rank that cannot get memory says so in one line (and exits 1, so that torchrun stops the
    others at once rather than leaving them waiting in a collective)."""
    import moemesh.cli as cli

    def train(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")

    monkeypatch.setattr(cli, "_train", train)
    monkeypatch.setenv("RANK", "3")
    assert main(["train"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(
        "moemesh train: error: rank 3: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    )
    assert "train.micro_batch" in err and "moemesh estimate" in err


def test_a_users_allocator_setting_stands():
    """The inference commands set expandable segments only where neither of torch's variables is set."""
    for given in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_ALLOC_CONF": "backend:native"}):
        environ = dict(given)
        inference_allocator(environ)
        assert environ == given
    environ = {}
    inference_allocator(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
