"""Chat and instruction rows (data/chat.py, data/packing.py, `moemesh data`): each format's trained
tokens equal spans computed here by hand from ChatML; the refused rows and templates; packing by
row; and a packed step's loss and every gradient equal to its rows run one by one (CPU, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers", reason="a tokenizer.json needs the tokenizers package")

from moemesh.cli import main  # noqa: E402
from moemesh.config import DataConfig  # noqa: E402
from moemesh.data.dataset import load_dataset  # noqa: E402
from moemesh.data.packing import best_fit  # noqa: E402
from moemesh.data.tokenizer import HFTokenizer  # noqa: E402
from moemesh.errors import DataError  # noqa: E402
from moemesh.models import ModelConfig, build  # noqa: E402
from moemesh.models.transformer import shift_labels  # noqa: E402
from moemesh.ops import invariant  # noqa: E402
from serving import write_checkpoint  # noqa: E402

VOCAB = 320
CONVERSATIONS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "the quick brown fox"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hello world"},
    ],
    [{"role": "user", "content": "def main():"}, {"role": "assistant", "content": "    return 0"}],
    [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "quick"}],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("chat"))


def chatml(messages, trained_roles=("assistant",), only_last=False):
    """ChatML by hand, and the [start, end) spans of the trained turns' content + <|im_end|>."""
    text, spans = "", []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] in trained_roles and (not only_last or i == last):
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


def expected_labels(tokenizer, text, spans, eos=False):
    encoding = tokenizer._tokenizer.encode(text, add_special_tokens=False)
    ids = list(encoding.ids)
    trained = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
    if eos:
        ids, trained = ids + [tokenizer.eos_id], trained + [True]
    trained[0] = False
    return ids, [t if keep else -100 for t, keep in zip(ids, trained)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_of(output):
    """The rows of `moemesh data --output`'s sequences: (input ids, labels) each, padding left out."""
    rows = []
    for line in output.read_text().splitlines():
        record = json.loads(line)
        starts = [i for i, p in enumerate(record["position_ids"]) if p == 0] + [len(record["position_ids"])]
        for a, b in zip(starts[:-1], starts[1:]):
            if any(label != -100 for label in record["labels"][a:b]):
                rows.append((record["input_ids"][a:b], record["labels"][a:b]))
    return sorted(rows)


def data_output(tmp_path, checkpoint, data_file, *overrides):
    out = tmp_path / "packed.jsonl"
    args = [
        "data",
        "--set",
        f"data.path={data_file}",
        f"train.init_from={checkpoint}",
        "train.seq_len=96",
        "data.val_fraction=0.01",
        *overrides,
        "--output",
        str(out),
    ]
    assert main(args) == 0
    return out


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_the_labels_of_moemesh_data_are_the_spans_computed_by_hand(tmp_path, checkpoint, train_on, capsys):
    tokenizer = HFTokenizer(checkpoint / "tokenizer.json")
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 2])
    out = data_output(tmp_path, checkpoint, data, f"data.train_on={train_on}")
    expected = []
    for messages in CONVERSATIONS * 2:
        text, spans = chatml(messages, only_last=train_on == "last_assistant")
        spans = [(0, len(text))] if train_on == "all" else spans
        expected.append(expected_labels(tokenizer, text, spans))
    # the last row is held out for validation (data.val_fraction): the rest are the packed rows
    assert rows_of(out) == sorted(expected[:-1])
    said = capsys.readouterr().out
    assert "6 rows packed by row into" in said and "wrote" in said


def test_sharegpt_prompt_completion_and_alpaca_rows(tmp_path, checkpoint):
    tokenizer = HFTokenizer(checkpoint / "tokenizer.json")
    sharegpt = [
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "the quick brown fox"}]}
    ] * 3
    out = data_output(tmp_path, checkpoint, write_rows(tmp_path / "sharegpt.jsonl", sharegpt))
    pair = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick brown fox"}]
    text, spans = chatml(pair)
    assert rows_of(out) == [expected_labels(tokenizer, text, spans)] * 2

    strings = [{"prompt": "def main():\n", "completion": "    return 0\n"}] * 3
    out = data_output(tmp_path, checkpoint, write_rows(tmp_path / "pc.jsonl", strings))
    span = [(len("def main():\n"), len("def main():\n    return 0\n"))]
    assert rows_of(out) == [expected_labels(tokenizer, "def main():\n    return 0\n", span, eos=True)] * 2

    messages = [
        {"prompt": [{"role": "user", "content": "fox"}], "completion": [{"role": "assistant", "content": "quick"}]}
    ] * 3
    out = data_output(tmp_path, checkpoint, write_rows(tmp_path / "pcm.jsonl", messages))
    text, spans = chatml([{"role": "user", "content": "fox"}, {"role": "assistant", "content": "quick"}])
    assert rows_of(out) == [expected_labels(tokenizer, text, spans)] * 2

    alpaca = [{"instruction": "say hello", "input": "world", "output": "hello world"}] * 3
    out = data_output(tmp_path, checkpoint, write_rows(tmp_path / "alpaca.jsonl", alpaca))
    text, spans = chatml(
        [{"role": "user", "content": "say hello\n\nworld"}, {"role": "assistant", "content": "hello world"}]
    )
    assert rows_of(out) == [expected_labels(tokenizer, text, spans)] * 2


def test_generation_markers_say_what_trains(tmp_path, checkpoint):
    """A template with {% generation %} blocks: the blocks train, whatever the turn-by-turn rule says."""
    marked = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}"
        "{{ '\\n' }}{% endfor %}"
    )
    (tmp_path / "marked.jinja").write_text(marked)
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    out = data_output(tmp_path, checkpoint, data, f"data.chat_template={tmp_path / 'marked.jinja'}")
    tokenizer = HFTokenizer(checkpoint / "tokenizer.json")
    assert rows_of(out) == sorted(expected_labels(tokenizer, *chatml(m)) for m in CONVERSATIONS[:-1])


# Qwen3's rule in a few lines: an assistant turn after the last user message gets a <think> block,
# earlier ones lose it — so a turn renders differently alone than within the conversation.
THINKING = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
    "loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "rows, overrides, message",
    [
        (['{"messages": [{"role": "user", "content": "hi"}'], [], "line 1 column"),  # not JSON
        (
            [json.dumps({"messages": CONVERSATIONS[1]}), json.dumps({"messages": [{"role": "robot", "content": "x"}]})],
            [],
            "chat.jsonl line 2: \"messages\"[0]: unknown role 'robot'",
        ),
        ([json.dumps({"messages": [{"role": "user", "content": "hi"}]})], [], "line 1: the conversation has no"),
        ([json.dumps({"conversations": [{"from": "alien", "value": "x"}]})], [], "unknown \"from\" 'alien'"),
        ([json.dumps({"question": "x"})], [], "cannot tell the data's format"),
        ([json.dumps({"messages": CONVERSATIONS[0]})], ["data.too_long=error", "train.seq_len=8"], "more than"),
        ([json.dumps({"messages": CONVERSATIONS[0]})], ["THINKING"], "not prefix-preserving"),
        ([json.dumps({"messages": CONVERSATIONS[0]})], ["data.format=alpaca"], 'expected an object with "instruction"'),
    ],
)
def test_refused_rows_and_templates_are_one_line(tmp_path, checkpoint, capsys, rows, overrides, message):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(rows) + "\n")
    if overrides == ["THINKING"]:
        (tmp_path / "thinking.jinja").write_text(THINKING)
        overrides = [f"data.chat_template={tmp_path / 'thinking.jinja'}"]
    args = ["data", "--set", f"data.path={data}", f"train.init_from={checkpoint}", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_thinking_template_trains_its_last_turn_with_last_assistant(tmp_path, checkpoint):
    (tmp_path / "thinking.jinja").write_text(THINKING)
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}] * 3)
    out = data_output(
        tmp_path, checkpoint, data, f"data.chat_template={tmp_path / 'thinking.jinja'}", "data.train_on=last_assistant"
    )
    tokenizer = HFTokenizer(checkpoint / "tokenizer.json")
    text, _ = chatml(CONVERSATIONS[0])
    text = text.replace("assistant\nhello world", "assistant\n<think>\n\n</think>\n\nhello world")
    start = text.index("<think>")
    end = text.rindex("<|im_end|>") + len("<|im_end|>")
    assert rows_of(out) == [expected_labels(tokenizer, text, [(start, end)])] * 2


def test_a_template_without_messages_support_and_too_long_rows(tmp_path, checkpoint):
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 4])
    tokenizer = str(checkpoint / "tokenizer.json")
    with pytest.raises(DataError, match="no chat template"):
        load_dataset(DataConfig(path=str(data)), 96, 0, VOCAB)  # the byte tokenizer has none
    dataset, _ = load_dataset(DataConfig(path=str(data), tokenizer=tokenizer), 40, 0, VOCAB)
    assert dataset.stats.dropped == {"longer than train.seq_len=40 dropped (data.too_long)": 4}  # the long one
    assert "4 longer than train.seq_len=40 dropped (data.too_long) (the first at " in dataset.describe()
    truncated, _ = load_dataset(DataConfig(path=str(data), tokenizer=tokenizer, too_long="truncate"), 40, 0, VOCAB)
    assert truncated.stats.truncated == 4 and truncated.train_rows + truncated.val_rows == 12


def test_packing_is_best_fit_deterministic_and_read_as_windows_are(tmp_path, checkpoint):
    lengths = np.random.default_rng(0).integers(1, 50, size=200)
    bins = best_fit(lengths, 64, seed=1)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= int(np.ceil(lengths.sum() / 64 * 1.1))  # within 10% of the bound
    assert bins == best_fit(lengths, 64, seed=1)
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 10])
    config = DataConfig(path=str(data), tokenizer=str(checkpoint / "tokenizer.json"))
    dataset, _ = load_dataset(config, 96, 0, VOCAB)
    whole = dataset.train_sequences(0, 12)
    part = dataset.train_sequences(5, 4)  # resumed at sequence 5: what the whole run read there
    assert torch.equal(part.tokens, whole.tokens[5:9]) and torch.equal(part.positions, whole.positions[5:9])
    assert dataset.val_rows == 1 and dataset.trained_tokens > 0


TINY = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=128,
)


def one_by_one(model, batch):
    """The mean loss over the trained tokens of `batch`'s rows, each run alone (its gradients
    added into the parameters)."""
    total_labels = int((shift_labels(batch.labels) != -100).sum())
    loss = 0.0
    for s in range(len(batch)):
        starts = (batch.positions[s] == 0).nonzero().flatten().tolist() + [batch.positions.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            labels = batch.labels[s : s + 1, a:b]
            count = int((shift_labels(labels) != -100).sum())
            if count:
                out = model(batch.tokens[s : s + 1, a:b], labels=labels, return_logits=False)
                (out.ce_loss * count / total_labels).backward()
                loss += out.ce_loss.item() * count / total_labels
    return loss


@pytest.mark.parametrize("mode", ["eager", "batch_invariant"])
def test_a_packed_step_is_its_rows_one_by_one(tmp_path, checkpoint, mode):
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 6])
    config = DataConfig(path=str(data), tokenizer=str(checkpoint / "tokenizer.json"))
    dataset, _ = load_dataset(config, 96, 0, VOCAB)
    batch = dataset.train_sequences(0, 2 if mode == "batch_invariant" else 4)
    assert (batch.positions == 0).sum() > len(batch)  # several rows a sequence
    model = build(TINY.replace(output_router_logits=False), seed=1)
    with invariant.batch_invariant(mode == "batch_invariant"):
        out = model(batch.tokens, labels=batch.labels, positions=batch.positions, return_logits=False)
        out.ce_loss.backward()
        packed = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        alone = one_by_one(model, batch)
    assert abs(out.ce_loss.item() - alone) <= 1e-5 * alone
    for name, p in model.named_parameters():
        assert ((p.grad - packed[name]).norm() / packed[name].norm()).item() <= 1e-5, name


def test_the_trainer_s_step_loss_is_a_mean_over_trained_tokens_whatever_the_micro_batches(tmp_path, checkpoint):
    from moemesh.config import config_from_dict
    from moemesh.train.trainer import Trainer
    from tiny_run import TINY_TRAIN

    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 6])
    losses, grads = [], []
    for micro in (1, 2, 4):
        train = {**TINY_TRAIN, "seq_len": 96, "global_batch": 4, "micro_batch": micro, "run_dir": str(tmp_path / "r")}
        raw = {
            "model": {**TINY.to_hf_dict(), "output_router_logits": False},
            "train": train,
            "data": {"path": str(data), "tokenizer": str(checkpoint / "tokenizer.json")},
        }
        trainer = Trainer(config_from_dict(raw))
        batch = trainer.dataset.train_sequences(0, 4)
        ce, _ = trainer.forward_backward(batch.split(micro))
        losses.append(ce.item())
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    model = build(TINY.replace(output_router_logits=False), seed=TINY_TRAIN.get("seed", 0))
    model.load_state_dict(trainer.model.state_dict())
    alone = one_by_one(model, batch)
    for loss, grad in zip(losses, grads):
        assert abs(loss - alone) <= 1e-5 * alone
        assert ((grad - grads[0]).norm() / grads[0].norm()).item() <= 1e-5


def test_the_checkpoint_carries_the_template_the_run_trained_with(tmp_path, checkpoint, capsys):
    """data.chat_template travels into the checkpoint as chat_template.jinja (which a loaded
    tokenizer's template prefers), so generate/serve chat as the run trained; a template whose end
    of turn is not the tokenizer's eos is said, and a served chat stops at both."""
    from moemesh.data.template import load_chat_template
    from tiny_run import TINY_TRAIN

    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|endoftext|>"}))
    template = tmp_path / "chatml.jinja"
    template.write_text(settings["chat_template"])
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 4])
    args = [
        "train",
        "--set",
        f"data.path={data}",
        f"data.tokenizer={tokenizer_dir / 'tokenizer.json'}",
        f"data.chat_template={template}",
        f"model.vocab_size={VOCAB}",
        *(f"train.{k}={v}" for k, v in {**TINY_TRAIN, "steps": 1, "seq_len": 96, "eval_every": 0}.items()),
        f"train.run_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "chat    a turn ends with <|im_end|> (trained), not the tokenizer's eos <|endoftext|>" in out
    saved = tmp_path / "run" / "checkpoints" / "step_1"
    assert (saved / "chat_template.jinja").read_text() == settings["chat_template"]
    loaded = load_chat_template(HFTokenizer(saved / "tokenizer.json"))
    assert loaded.source == settings["chat_template"] and loaded.end_of_turn == "<|im_end|>"


def test_an_openai_tool_call_row_trains_on_what_serve_renders():
    """An assistant turn in OpenAI's form (content null, arguments a JSON string) renders as serve
    renders a request's (content "", the arguments the object): not "None", not a quoted string."""
    from moemesh.data.chat import _messages
    from moemesh.data.template import ChatTemplate
    from serving import TOOLS_TEMPLATE

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Rome"}'}}
    rows = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = ChatTemplate(TOOLS_TEMPLATE).render(_messages(rows, "messages", "messages"), False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
    )
    for arguments, message in [("{", "arguments is not JSON"), ("[1]", "arguments must be a JSON object")]:
        bad = [rows[0], {**rows[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": arguments}}]}]
        with pytest.raises(DataError, match=rf'"messages"\[1\].tool_calls\[0\].function.{message}'):
            _messages(bad, "messages", "messages")
