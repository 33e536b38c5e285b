"""Every request field of OpenAI's completions and chat completions, driven with the official
`openai` client (and raw httpx for malformed bodies) against a live `moemesh serve` on 127.0.0.1:
each works as OpenAI documents it — checked against a full forward of the model (fp32, CPU) where
it is a number — or is refused with a 400 naming it. And no request can hurt another: a row whose
processing raises fails alone, clients that leave free their rows at once, and hundreds of random
malformed bodies leave the server answering as before.

Tolerances: log-probabilities against a no-cache forward of the whole sequence, fp32 on CPU,
1e-5 absolute (the cached and the whole-sequence forwards differ by ~1e-6 in the logits).
Penalised greedy texts are compared token for token with a reference loop that applies the
documented formula (OpenAI's, or transformers' own RepetitionPenaltyLogitsProcessor) to the
full forward's logits: their top two logits are far apart with these random weights."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests use the openai client")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")

from moemesh.inference.engine import DecodeEngine  # noqa: E402
from moemesh.inference.generate import load_for_generation  # noqa: E402
from moemesh.inference.protocol import CHAT_FIELDS, COMPLETION_FIELDS, derived_seed  # noqa: E402
from moemesh.inference.server import Service  # noqa: E402
from serving import ServerThread, openai_client, write_checkpoint  # noqa: E402

KEY = "k"
ROWS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_for_generation(checkpoint)


@pytest.fixture(scope="module")
def server(loaded):
    model, tokenizer = loaded
    service = Service(
        DecodeEngine(model, max_batch=ROWS, max_len=1024), tokenizer, model_name="tiny", api_key=KEY, max_waiting=16
    )
    running = ServerThread(service)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai_client(server.url, KEY)


def post(server, body, path="/v1/completions", **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    if not isinstance(body, (str, bytes)):
        body = json.dumps(body)
        headers.setdefault("Content-Type", "application/json")
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kwargs)


def _idle(server, timeout=10.0) -> bool:
    scheduler = server.service.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not scheduler.running and not scheduler.waiting and len(scheduler.free_rows) == ROWS:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def submitted(server, monkeypatch):
    """The scheduler's sequences of the requests a test makes, in order."""
    sequences = []
    submit = server.service.scheduler.submit
    monkeypatch.setattr(server.service.scheduler, "submit", lambda *a: sequences.append(submit(*a)) or sequences[-1])
    return sequences


def _forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _prompt(tokenizer, text: str) -> list[int]:
    return [tokenizer.eos_id, *tokenizer.encode(text)]


# ---- lengths ----------------------------------------------------------------------------------------


def test_lengths_chat_runs_to_the_context_completions_keep_16(client, loaded):
    _, tokenizer = loaded
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0
    )
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    # no limit given: the rest of the context (a long prompt leaves ~20 tokens of the 1024)
    words = 400
    while True:
        content = "hello world " * words
        prompt = tokenizer.encode(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
        if len(prompt) <= 1004:
            break
        words -= 1
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], temperature=0)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 1024 - len(prompt) and reply.choices[0].finish_reason == "length"
    assert client.completions.create(model="tiny", prompt="hi", temperature=0).usage.completion_tokens == 16


# ---- log-probabilities ------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_logprobs_are_those_of_the_distribution_sampled_from(client, loaded, submitted, top_p):
    model, tokenizer = loaded
    reply = client.completions.create(
        model="tiny", prompt="def main", max_tokens=12, temperature=1.0, top_p=top_p, seed=4, logprobs=20
    )
    sequence = submitted[0]
    logprobs = reply.choices[0].logprobs
    ids = sequence.prompt_ids + sequence.token_ids
    reference = _forward_logits(model, ids)[len(sequence.prompt_ids) - 1 : -1]
    if top_p < 1:  # the nucleus: tokens after those whose mass reaches top_p are out
        probs = torch.softmax(reference, -1)
        ordered, order = probs.sort(-1, descending=True)
        outside = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, ordered.cumsum(-1) - ordered >= top_p)
        reference = reference.masked_fill(outside, float("-inf"))
    reference = torch.log_softmax(reference, -1)
    assert len(logprobs.token_logprobs) == len(sequence.token_ids) == 12
    for i, token in enumerate(sequence.token_ids):
        assert abs(logprobs.token_logprobs[i] - reference[i, token]) <= 1e-5
        top = reference[i].topk(20)
        kept = sequence.logprobs[i].top  # what the server computed: (token id, log-probability), best first
        finite = int(top.values.isfinite().sum())  # beyond them, ties at -inf in any order
        assert [t for t, _ in kept][:finite] == top.indices.tolist()[:finite]
        assert all(abs(v - max(float(r), -9999.0)) <= 1e-5 for (_, v), r in zip(kept, top.values))
        # sent as OpenAI's {token string: log-probability}, the chosen token's too (equal strings merge)
        sent = {tokenizer.decode([t]): v for t, v in kept}
        assert logprobs.top_logprobs[i] == {
            **sent,
            **({} if tokenizer.decode([token]) in sent else {tokenizer.decode([token]): logprobs.token_logprobs[i]}),
        }
    if top_p < 1:
        assert any(-9999.0 in t.values() for t in logprobs.top_logprobs)  # tokens outside the nucleus: -inf
    # tokens and offsets spell the text
    text = reply.choices[0].text
    assert logprobs.tokens == [tokenizer.decode([t]) for t in sequence.token_ids]
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    if "\ufffd" not in "".join(logprobs.tokens):
        assert "".join(logprobs.tokens) == text
        assert all(text.startswith(t, o) for t, o in zip(logprobs.tokens, logprobs.text_offset))


def test_chat_logprobs_greedy_at_temperature_one(client, loaded, submitted):
    model, tokenizer = loaded
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    sequence = submitted[0]
    reference = torch.log_softmax(_forward_logits(model, sequence.prompt_ids + sequence.token_ids), -1)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for i, (entry, token) in enumerate(zip(content, sequence.token_ids)):
        row = reference[len(sequence.prompt_ids) - 1 + i]
        assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - row[token]) <= 1e-5 and int(row.argmax()) == token
        assert [abs(t.logprob - v) <= 1e-5 for t, v in zip(entry.top_logprobs, row.topk(3).values)] == [True] * 3
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], top_logprobs=2)


def test_echo_gives_the_prompt_with_its_logprobs(client, loaded, server):
    model, tokenizer = loaded
    prompt = _prompt(tokenizer, "the quick brown")
    reference = torch.log_softmax(_forward_logits(model, prompt), -1)
    for max_tokens in (0, 4):
        reply = client.completions.create(
            model="tiny", prompt="the quick brown", max_tokens=max_tokens, temperature=0, echo=True, logprobs=2
        )
        choice = reply.choices[0]
        assert choice.text.startswith("the quick brown") and len(choice.logprobs.tokens) == len(prompt) + max_tokens
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert abs(choice.logprobs.token_logprobs[i] - reference[i - 1, prompt[i]]) <= 1e-5
        offsets = choice.logprobs.text_offset
        assert offsets[len(prompt)] == len("the quick brown") if max_tokens else len(offsets) == len(prompt)
        assert reply.usage.completion_tokens == max_tokens
    chunks = list(
        client.completions.create(
            model="tiny", prompt="the quick brown", max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert post(server, {"prompt": "a", "max_tokens": 0}).json()["error"]["param"] == "max_tokens"


# ---- n, best_of, seeds ------------------------------------------------------------------------------


def test_n_choices_are_independent_seeded_sequences(client):
    ask = dict(model="tiny", prompt="hello", max_tokens=10, temperature=1.0, seed=7)
    many = client.completions.create(n=3, **ask)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    assert len(set(texts)) == 3
    assert texts == [client.completions.create(**{**ask, "seed": derived_seed(7, i)}).choices[0].text for i in range(3)]
    streamed = ["", "", ""]
    for chunk in client.completions.create(n=3, stream=True, **ask):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == texts
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], n=2, max_tokens=5, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    assert many.usage.prompt_tokens == client.completions.create(**ask).usage.prompt_tokens  # the prompt once


def test_streamed_logprobs_add_up_to_the_whole(client):
    ask = dict(model="tiny", prompt="def main", max_tokens=10, temperature=1.0, seed=2, logprobs=2, n=2)
    whole = client.completions.create(**ask)
    tokens, values = [[], []], [[], []]
    for chunk in client.completions.create(stream=True, **ask):
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            tokens[choice.index] += choice.logprobs.tokens
            values[choice.index] += choice.logprobs.token_logprobs
    assert tokens == [c.logprobs.tokens for c in whole.choices]
    # The same tokens; their values to fp32's rounding only: the two requests' sequences may share
    # a step with different company (one prefill or two, a decode batch of 2 or 4), which rounds
    # the same logits differently in the last bits.
    for ours, theirs in zip(values, [c.logprobs.token_logprobs for c in whole.choices]):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-5)


def test_structured_output_with_the_byte_tokenizer():
    """The byte tokenizer's one-byte tokens, under a schema, through generate (no server)."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install moemesh[serve])")
    from moemesh.data.tokenizer import ByteTokenizer
    from moemesh.inference.generate import generate
    from moemesh.inference.grammar import Grammars
    from moemesh.inference.request import SamplingParams
    from moemesh.models import build
    from test_models_decoding import FAMILIES

    model = build(FAMILIES["qwen3_moe"].replace(vocab_size=256, max_position_embeddings=128), seed=5).eval()
    tokenizer = ByteTokenizer()
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    grammar = Grammars(tokenizer, 256).compile(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, frozenset({0})
    )
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    for result in generate(DecodeEngine(model, max_batch=3, max_len=128), tokenizer, ["x", "y", "z"], params):
        assert result.finish_reason == "stop" and set(json.loads(result.text)) == {"ok"}


def test_best_of_returns_the_likeliest(client):
    ask = dict(model="tiny", prompt="def", max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **ask)
    means = [statistics.mean(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(best_of=4, **ask)
    assert len(best.choices) == 1 and best.choices[0].text == every.choices[means.index(max(means))].text
    assert best.usage.completion_tokens == 32  # every sequence's tokens
    with pytest.raises(openai.BadRequestError, match=r"best_of \(1\) must be at least n \(2\)"):
        client.completions.create(best_of=1, n=2, **ask)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(best_of=2, stream=True, **ask)


def test_any_integer_seed_and_one_request_cannot_fail_another(client, server):
    ask = dict(model="tiny", prompt="y", max_tokens=3, temperature=1.0)
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    huge = client.completions.create(seed=18446744073709551616, **ask)  # 2**64: 0 modulo 2**63
    assert huge.choices[0].text == client.completions.create(seed=0, **ask).choices[0].text
    assert client.completions.create(seed=-(10**30), **ask).choices[0].finish_reason == "length"
    rest = "".join(c.choices[0].text for c in stream)
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=40, temperature=0).choices[0].text
    assert first.choices[0].text + rest == whole


# ---- prompts, stops, biases, penalties --------------------------------------------------------------


def test_token_id_prompts(client, loaded):
    _, tokenizer = loaded
    ids = _prompt(tokenizer, "hello")
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0).choices[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == text
    two = client.completions.create(model="tiny", prompt=[ids, ids[:1]], max_tokens=8, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].text == text
    assert two.usage.prompt_tokens == len(ids) + 1


def test_stop_token_ids_and_stop_strings(client, server, submitted):
    free = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0)
    tokens = submitted[0].token_ids
    stopped = post(
        server, {"prompt": "hello", "max_tokens": 12, "temperature": 0, "stop_token_ids": [tokens[4]]}
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert submitted[1].token_ids == tokens[: tokens.index(tokens[4])]
    text = free.choices[0].text
    cut = client.completions.create(
        model="tiny", prompt="hello", max_tokens=12, temperature=0, stop=["\x00", text[5:8]]
    )
    assert cut.choices[0].text == text[: text.index(text[5:8])] and cut.choices[0].finish_reason == "stop"


def _greedy_reference(model, prompt: list[int], steps: int, process) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        logits = _forward_logits(model, ids)[-1]
        ids.append(int(process(logits, ids[: len(prompt)], ids[len(prompt) :]).argmax()))
    return ids[len(prompt) :]


def _openai_penalties(frequency: float, presence: float):
    def process(logits, prompt, generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).float()
        return logits - counts * frequency - (counts > 0).float() * presence

    return process


def _hf_repetition(penalty: float):
    from transformers import RepetitionPenaltyLogitsProcessor

    def process(logits, prompt, generated):
        return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), logits[None].clone())[0]

    return process


@pytest.mark.parametrize(
    "settings, reference",
    [
        ({"frequency_penalty": 1.5}, _openai_penalties(1.5, 0.0)),
        ({"presence_penalty": 2.0}, _openai_penalties(0.0, 2.0)),
        ({"frequency_penalty": -0.5, "presence_penalty": 1.0}, _openai_penalties(-0.5, 1.0)),
        ({"repetition_penalty": 1.8}, _hf_repetition(1.8)),
    ],
    ids=["frequency", "presence", "both", "repetition"],
)
def test_penalties_follow_their_definitions(server, loaded, submitted, settings, reference):
    model, _ = loaded
    # "def main" makes this model repeat one token: every penalty changes its greedy text
    reply = post(server, {"prompt": "def main", "max_tokens": 16, "temperature": 0, **settings}).json()
    plain = post(server, {"prompt": "def main", "max_tokens": 16, "temperature": 0}).json()
    sequence = submitted[0]
    assert sequence.token_ids == _greedy_reference(model, sequence.prompt_ids, 16, reference)
    assert reply["choices"][0]["text"] != plain["choices"][0]["text"]  # the penalty changed something


def test_logit_bias(client, server, submitted):
    free = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    first = submitted[0].token_ids[0]
    pushed = client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=0, logit_bias={"65": 100}
    )
    assert submitted[1].token_ids == [65] * 6 and pushed.usage.completion_tokens == 6
    banned = client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=0, logit_bias={str(first): -100}
    )
    assert submitted[2].token_ids[0] != first and banned.choices[0].text != free.choices[0].text
    for bias, message in [
        ({"x": 1}, "the key 'x' is not a token id"),
        ({"5": 101}, r"must be in \[-100, 100\]"),
        ({"320": 1}, r"320 is not a token id in \[0, 320\)"),
        ({"5": "a"}, "must be a number, got a string"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            client.completions.create(model="tiny", prompt="a", logit_bias=bias)
        assert error.value.body["param"] == "logit_bias"


# ---- structured output ------------------------------------------------------------------------------


def test_response_format_json_schema_is_followed(client):
    pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install moemesh[serve])")
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "answer"}],
            max_completion_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        value = json.loads(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop" and set(value) == {"answer", "n"}
        assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a"}],
        max_completion_tokens=30,
        response_format={"type": "json_object"},
        temperature=0,
    )
    assert reply.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match="response_format") as error:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}},
        )
    assert error.value.body["param"] == "response_format"


# ---- refusals ---------------------------------------------------------------------------------------

REFUSED = [
    (
        "/v1/completions",
        {"prompt": "a", "stream_options": {"include_usage": True}},
        "stream_options",
        "only with stream",
    ),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix", "fill-in-the-middle"),
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs", r"in [0, 20]"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs", "must be an integer"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, "seed", "must be an integer"),
    ("/v1/completions", {"prompt": "a", "n": 100}, "n", "at most 16 at once"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "hi\ud800"}, "prompt", "a lone surrogate U+D800 at character 2"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "tools": [{}]},
        "tools",
        "only function tools",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
        "max_completion_tokens",
        ">= 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "best_of": 2},
        "best_of",
        "unknown field",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "store": True},
        "store",
        "nothing is stored",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
        "only text parts",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "ok\udfff"}]},
        "messages[0].content",
        "U+DFFF at character 2",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}},
        "response_format",
        "json_schema",
    ),
]


@pytest.mark.parametrize("path, body, param, message", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_fields_are_named(server, path, body, param, message):
    reply = post(server, {"model": "tiny", **body}, path)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_accepted_no_op_fields(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a"}],
        max_tokens=2,
        temperature=0,
        user="u1",
        store=False,
        service_tier="auto",
        safety_identifier="s",
        response_format={"type": "text"},
    )
    assert reply.usage.completion_tokens == 2
    assert (
        client.completions.create(
            model="tiny", prompt="a", max_tokens=2, temperature=0, user="u"
        ).usage.completion_tokens
        == 2
    )


def test_non_json_bodies_are_refused(server):
    for headers, body in [
        ({"Content-Type": "application/x-www-form-urlencoded"}, "prompt=hello&max_tokens=3"),
        ({"Content-Type": "text/plain"}, '{"prompt": "hello"}'),
        ({"Content-Type": "multipart/form-data; boundary=x"}, "--x--"),
    ]:
        reply = post(server, body, headers=headers)
        assert reply.status_code == 415 and "must be JSON" in reply.json()["error"]["message"]


def test_a_chat_template_that_raises_is_a_400(server):
    """A template's own error (raise_exception, as Hugging Face templates refuse a role) and one
    that breaks while rendering are both the request's 400, naming messages (the HTTP process's
    protocol object, as it answers with it; ApiError's way to a 400 is the other tests')."""
    from moemesh.inference.chat import ChatTemplate
    from moemesh.inference.front import Front
    from moemesh.inference.protocol import ApiError, chat_plan

    served = Front(server.service.settings, link=None).served
    template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ApiError, match="System role not supported") as error:
        chat_plan({"messages": [{"role": "system", "content": "a"}]}, replace(served, chat_template=template))
    assert error.value.status == 400 and error.value.body()["error"]["param"] == "messages"
    broken = replace(served, chat_template=ChatTemplate("{{ messages[0]['content'] + 5 }}"))
    with pytest.raises(ApiError) as error:
        chat_plan({"messages": [{"role": "user", "content": "a"}]}, broken)
    assert error.value.status == 400


def test_message_keys_reach_the_template():
    """A message's `name` (as OpenAI documents it) and any key of its own (as vLLM passes them) are
    given to the chat template as sent; a name that is not a string is the request's 400."""
    from moemesh.data.tokenizer import ByteTokenizer
    from moemesh.inference.chat import ChatTemplate
    from moemesh.inference.grammar import Grammars
    from moemesh.inference.protocol import ApiError, Served, chat_plan

    tokenizer = ByteTokenizer()
    template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}/{{ m.get('name', '-') }}/{{ m.get('reasoning_content', '-') }}/"
        "{{ m.get('weight', '-') }}: {{ m['content'] }}\n{% endfor %}"
    )
    served = Served(tokenizer, 256, 256, template, (), Grammars(tokenizer, 256), 8)
    messages = [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": "hi", "name": "ann", "weight": 0},
        {"role": "assistant", "content": "ok", "reasoning_content": "short"},
    ]
    plan = chat_plan({"messages": messages}, served)
    rendered = tokenizer.decode(plan.prompts[0])
    assert rendered == "system/rules/-/-: be brief\nuser/ann/-/0: hi\nassistant/-/short/-: ok\n"
    with pytest.raises(ApiError, match=r"messages\[0\].name must be a string") as error:
        chat_plan({"messages": [{"role": "user", "content": "a", "name": 3}]}, served)
    assert error.value.status == 400


def test_lone_surrogates_with_the_byte_tokenizer():
    from moemesh.data.tokenizer import ByteTokenizer
    from moemesh.inference.grammar import Grammars
    from moemesh.inference.protocol import ApiError, Served, completion_plan

    tokenizer = ByteTokenizer()
    served = Served(tokenizer, 64, 256, None, (), Grammars(tokenizer, 256), 8)
    with pytest.raises(ApiError, match="prompt is not valid Unicode: a lone surrogate U\\+D800 at character 3"):
        completion_plan({"prompt": "caf\ud800"}, served)
    with pytest.raises(ApiError, match=r"prompt\[1\] is not valid Unicode: a lone surrogate U\+DCE9 at character 0"):
        completion_plan({"prompt": ["ok", "\udce9"]}, served)


def test_models_by_id_and_retry_after(client, server, monkeypatch):
    assert client.models.retrieve("tiny").id == "tiny"
    reply = httpx.get(server.url + "/v1/models/other/name", headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    monkeypatch.setattr(server.service.scheduler, "max_waiting", 0)  # as if the queue were full
    reply = post(server, {"prompt": "a"})
    assert (
        reply.status_code == 503
        and reply.headers["retry-after"] == "1"
        and reply.json()["error"]["code"] == "server_busy"
    )


def test_every_request_is_logged(client, caplog):
    with caplog.at_level("INFO", logger="moemesh.serve"):
        client.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=0)
        list(client.completions.create(model="tiny", prompt="a", max_tokens=4, temperature=0, stream=True))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="a", max_tokens=-1)
        deadline = time.monotonic() + 5
        while len(caplog.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "moemesh.serve"]
    for start in ("200 prompt_tokens=2 completion_tokens=3 ", "200 prompt_tokens=2 completion_tokens=4 ", "400 "):
        assert any(line.startswith("POST /v1/completions " + start) and line.endswith(" s") for line in lines), lines


def test_the_field_table_covers_every_field():
    table = (Path(__file__).parent.parent / "docs" / "openai_api.md").read_text()
    documented = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert COMPLETION_FIELDS | CHAT_FIELDS <= documented, sorted((COMPLETION_FIELDS | CHAT_FIELDS) - documented)


# ---- isolation --------------------------------------------------------------------------------------


def test_a_failing_row_fails_alone(client, server, monkeypatch):
    """Four requests share the decode steps; the processing of one raises at its 4th token. The
    other three (one of them processed too: log-probabilities) finish with their text alone."""
    from moemesh.inference.processing import RowSampler

    asks = [
        dict(prompt="hello", max_tokens=30, temperature=0),
        dict(prompt="def main", max_tokens=30, temperature=1.0, seed=5, logprobs=1),
        dict(prompt="the quick", max_tokens=30, temperature=0.7, top_p=0.9, seed=6),
        dict(prompt="fail", max_tokens=30, temperature=1.0, seed=666, logprobs=0),
    ]
    alone = [client.completions.create(model="tiny", **a).choices[0].text for a in asks[:3]]
    choose = RowSampler.choose

    def failing(self, logits, drawn, step):
        if self.params.seed == 666 and step == 3:
            raise RuntimeError("injected")
        return choose(self, logits, drawn, step)

    monkeypatch.setattr(RowSampler, "choose", failing)
    server.service.scheduler.decode_batches.clear()
    results, barrier = {}, threading.Barrier(4)

    def run(i):
        barrier.wait()
        try:
            results[i] = client.completions.create(model="tiny", **asks[i]).choices[0].text
        except openai.InternalServerError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(3)] == alone
    assert isinstance(results[3], openai.InternalServerError) and "RuntimeError: injected" in results[3].message
    assert max(server.service.scheduler.decode_batches) >= 3  # they did share steps
    assert _idle(server)


def test_clients_that_leave_free_their_rows_at_once(server, client):
    """16 non-streaming requests abandoned by their clients (a 0.3 s timeout) while their tokens
    flow: their rows are free within a few steps of the last client leaving, and a new request
    is as fast as on an idle server — within 20%, plus 100 ms; each the best of five requests,
    since this shared 2-core machine's load makes any single timing noisy."""
    ask = dict(model="tiny", prompt="hello", max_tokens=48, temperature=0)
    scheduler = server.service.scheduler

    def timed():
        start = time.perf_counter()
        client.completions.create(**ask)
        return time.perf_counter() - start

    idle = min(timed() for _ in range(5))

    def abandon(i):
        try:
            httpx.post(
                server.url + "/v1/completions",
                json={"prompt": f"x {i}", "max_tokens": 900, "temperature": 0},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=0.3,
            )
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=abandon, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = Counter(scheduler.decode_batches)
    after = min(timed() for _ in range(5))
    assert _idle(server)
    # Steps since the last client left: the new requests' 5 x 47 (their first token is the prefill's),
    # and a few that still carried abandoned rows — a row goes at the first step after the server's
    # event loop sees its client's disconnect, which on this loaded machine can take ~10 steps of
    # ~3 ms (the abandoned requests had ~850 tokens each to go).
    since = scheduler.decode_batches - left
    assert since.total() <= 5 * 47 + 20 and sum(n for batch, n in since.items() if batch > 1) <= 20, since
    assert after <= 1.2 * idle + 0.1, (after, idle)


# ---- fuzz -------------------------------------------------------------------------------------------


def _bad_bodies(rng: random.Random, count: int):
    """(path, raw body, content type): each malformed in one or two ways, never a valid request."""

    def text():
        return "".join(
            rng.choice(["a", "é", "\u2603", "\U0001f600", "\x00", "\ud800", '"', "\\"])
            for _ in range(rng.randint(0, 8))
        )

    junk = [
        None,
        True,
        -1,
        0,
        1.5,
        1e308,
        -1e308,
        10**30,
        -(10**30),
        "",
        "x",
        [],
        {},
        [1, "a"],
        {"a": {}},
        float("nan"),
        float("inf"),
    ]
    wrong = {
        "prompt": [5, True, {}, [], [[]], [-1], [10**6], [[1], "a"], [1.5], "hi\ud800", [[[1]]]],
        "max_tokens": [-1, 0, 1.5, "3", True, 10**30, []],
        "temperature": [-0.1, "1", True, float("nan"), float("inf"), -(10**400), []],
        "top_p": [0, 1.5, -3, "a", 10**400, float("nan")],
        "n": [0, -1, 10**20, 1.5, "2", 999],
        "best_of": [0, -5, "3", 1.5],
        "seed": [1.5, "1", True, [], {}],
        "logprobs": [21, -1, True, 1.5, "2"],
        "echo": ["no", 1, []],
        "logit_bias": [{"x": 1}, {"5": 101}, {"99999": 1}, [1], {"5": "a"}, {"-1": 0}, {"5": float("nan")}, {"٣": 1}],
        "stop": ["", [""], [1], {"a": 1}, 5],
        "stop_token_ids": [[-1], [10**9], ["a"], 3, [1.5]],
        "presence_penalty": [2.5, -3, "x", float("inf")],
        "frequency_penalty": [2.01, -2.01, [], 10**400],
        "repetition_penalty": [0, -1, "x", float("nan")],
        "stream": ["yes", 1, [], {}],
        "suffix": ["x", 5],
        "user": [5, [], {}],
        "model": [5, "other", "\ud800", [], "tiny\x00"],
    }
    chat_wrong = {
        "messages": [
            [],
            {},
            "a",
            [{}],
            [{"role": "x", "content": "a"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [{"role": "user", "content": "\udfff"}],
            [{"role": "user", "content": "a", "name": 5}],  # other keys pass to the template, but a name is a string
            [{"role": "user", "content": "a", "x": "\udfff"}],  # and no key's text holds a lone surrogate
            [{"role": "user", "tool_calls": [{}]}],
            [None],
        ],
        "max_completion_tokens": [0, -1, "5", 10**6],
        "top_logprobs": [21, -1, "1"],
        "response_format": [
            {"type": "xml"},
            "json",
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}},
            {},
        ],
        "tools": [[{}], "x"],
        "service_tier": ["flex", 5],
        "store": [True, "x"],
        "modalities": [["audio"], "text"],
    }
    for _ in range(count):
        chat = rng.random() < 0.35
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": "tiny", "max_tokens": 2}
        body.update({"messages": [{"role": "user", "content": text()}]} if chat else {"prompt": text() or "x"})
        kind = rng.random()
        if kind < 0.55:
            table = {**wrong, **chat_wrong} if chat else wrong
            name = rng.choice(
                [k for k in table if not (chat and k in ("prompt", "best_of", "echo", "suffix", "logprobs"))]
            )
            body[name] = rng.choice(table[name])
            if name == "prompt" and chat:
                body.pop("prompt")
            raw, kind_ = json.dumps(body), "application/json"
        elif kind < 0.65:  # an unknown field (any characters)
            body[text() + "_unknown" + str(rng.randint(0, 9))] = rng.choice(junk)
            raw, kind_ = json.dumps(body), "application/json"
        elif kind < 0.72:  # not an object
            raw, kind_ = json.dumps(rng.choice([[body], 5, "x", None, [], True, 1e308])), "application/json"
        elif kind < 0.79:  # broken JSON
            whole = json.dumps(body)
            raw, kind_ = (
                whole[: rng.randint(0, len(whole) - 2)] + rng.choice(["", ",", "\x00", "]"]),
                "application/json",
            )
        elif kind < 0.84:  # deep nesting
            depth = rng.choice([50, 5000, 100000])
            raw, kind_ = '{"model": "tiny", "prompt": ' + "[" * depth + "1" + "]" * depth + "}", "application/json"
        elif kind < 0.88:  # a number of thousands of digits
            raw, kind_ = '{"prompt": "a", "max_tokens": ' + "9" * rng.randint(20, 6000) + "}", "application/json"
        elif kind < 0.92:  # not UTF-8
            raw, kind_ = json.dumps(body).encode()[:-1] + bytes([rng.randint(0x80, 0xFF)]) + b"}", "application/json"
        elif kind < 0.96:  # not JSON at all
            raw, kind_ = (
                "prompt=a&max_tokens=2",
                rng.choice(["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"]),
            )
        else:  # big: a prompt beyond the context
            body["prompt"] = "hello world " * rng.randint(1000, 4000)
            body.pop("messages", None)
            raw, kind_, path = json.dumps(body), "application/json", "/v1/completions"
        yield path, raw, kind_


def test_fuzz_malformed_bodies(server, client):
    """600 seeded malformed bodies from 8 clients at once: each a 4xx with OpenAI's error object;
    then the server is idle and answers as before."""
    before = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0).choices[0].text
    bodies = list(_bad_bodies(random.Random(29), 600))
    start, statuses, failures = time.monotonic(), [], []

    def send(share):
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            for path, raw, kind in share:
                reply = http.post(path, content=raw, headers={"Content-Type": kind})
                statuses.append(reply.status_code)
                try:
                    error = reply.json()["error"]
                    ok = 400 <= reply.status_code < 500 and set(error) == {"message", "type", "param", "code"}
                except ValueError:
                    ok = False
                if not ok:
                    failures.append((raw[:300], reply.status_code, reply.text[:300]))

    threads = [threading.Thread(target=send, args=(bodies[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:5]
    assert len(statuses) == 600 and set(statuses) >= {400, 404, 415}
    assert time.monotonic() - start < 60
    assert _idle(server)
    assert (
        client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0).choices[0].text == before
    )
