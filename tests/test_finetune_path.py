"""The README's fine-tuning path, end to end as a newcomer takes it: a Hugging Face directory with
a tokenizer.json and a chat template, fine-tuned with `moemesh train --config FILE --set
train.init_from=DIR` where FILE says `tokenizer = "bytes"` (as configs/*.toml do), converted back
to a Hugging Face directory and served: the run trains on the directory's tokenizer and says so,
and the tokenizer's files (chat template included) travel into the checkpoint, through `convert`,
to the server's chat."""

from __future__ import annotations

import json
import os
import stat

import pytest

pytest.importorskip("tokenizers", reason="a tokenizer.json needs the tokenizers package")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")

import httpx  # noqa: E402

from moemesh.cli import main  # noqa: E402
from moemesh.config import dumps_toml  # noqa: E402
from moemesh.inference.engine import DecodeEngine  # noqa: E402
from moemesh.inference.generate import load_for_generation  # noqa: E402
from moemesh.inference.server import Service  # noqa: E402
from serving import ServerThread, write_checkpoint  # noqa: E402
from tiny_run import TINY_TRAIN, write_corpus  # noqa: E402

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def test_fine_tuning_keeps_the_tokenizer_and_the_chat_template(tmp_path, capsys):
    source = write_checkpoint(tmp_path / "source")
    config = tmp_path / "finetune.toml"
    train = {**TINY_TRAIN, "steps": 2, "save_every": 0, "eval_every": 0, "run_dir": str(tmp_path / "run")}
    config.write_text(dumps_toml({"train": train, "data": {"path": str(write_corpus(tmp_path)), "tokenizer": "bytes"}}))

    assert main(["train", "--config", str(config), "--set", f"train.init_from={source}"]) == 0
    out = capsys.readouterr().out
    assert f"(tokenizer {source / 'tokenizer.json'}: train.init_from's)" in out
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    for name in TOKENIZER_FILES:
        assert (checkpoint / name).read_bytes() == (source / name).read_bytes(), name
    sums = (checkpoint / "SHA256SUMS").read_text()
    assert all(f"  {name}\n" in sums for name in TOKENIZER_FILES)  # verified with the checkpoint

    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "converted")]) == 0
    converted = tmp_path / "converted"
    for name in TOKENIZER_FILES:
        assert (converted / name).read_bytes() == (source / name).read_bytes(), name
    for file in converted.iterdir():  # every file readable by others, as an ordinary new file
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file.name

    model, tokenizer = load_for_generation(converted)
    running = ServerThread(Service(DecodeEngine(model, max_batch=2, max_len=256), tokenizer, model_name="tuned"))
    try:
        reply = httpx.post(
            running.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(
            tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
        )
    finally:
        running.stop()


def test_a_chosen_tokenizer_wins_and_is_named(tmp_path, capsys):
    source = write_checkpoint(tmp_path / "source")
    config = tmp_path / "finetune.toml"
    train = {**TINY_TRAIN, "steps": 1, "save_every": 0, "eval_every": 0, "run_dir": str(tmp_path / "run")}
    config.write_text(dumps_toml({"train": train, "data": {"path": str(write_corpus(tmp_path))}}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    overrides = [f"train.init_from={source}", f"data.tokenizer={other / 'tokenizer.json'}"]
    assert main(["train", "--config", str(config), "--set", *overrides]) == 0
    out = capsys.readouterr().out
    assert f"(tokenizer {other / 'tokenizer.json'}: data.tokenizer, not train.init_from's" in out
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step_1").iterdir())
    assert "tokenizer.json" in names and "tokenizer_config.json" not in names  # other/ has none
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "config.json").read_text())["vocab_size"] == 320
