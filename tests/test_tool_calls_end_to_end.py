"""A tiny model that calls a tool by itself: `moemesh train` fine-tunes it on `messages` rows whose
assistant turns are a Hermes tool call and then an answer from the tool's result, the run
directory is served, and real clients drive it with tool_choice left at auto — an `openai-agents`
Agent whose @function_tool runs, and the `openai` client streamed and whole.

Unlike tests/test_inference_tool_calls.py (a random model, every call forced by the grammar), no
token here is constrained: the call is the model's, read by the Hermes parser the template's
<tool_call> chose, and the turn ends at the template's <|im_end|>. The tokenizer keeps a word's
trailing space with it ("In ", "Lima", ", ") and a JSON key with its colon and quote
('city": "'), so the city and the sky the model copies are the same tokens where it reads them
and where it writes them, each written after a token of its own: a 2-layer model learns the
pattern in 400 steps on one thread (about 40 s). The margin, measured: at 200 steps one seed of
three left the call's city at the most frequent one (as a GPT-2 split, " Lima" read and "Lima"
written, did); at 400 steps seeds 0, 1 and 2 all learn it. One thread: the same floats whatever
the machine's load.
"""

from __future__ import annotations

import json
import random

import pytest

openai = pytest.importorskip("openai", reason="the server tests use the openai client")
agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")
pytest.importorskip("tokenizers", reason="a tokenizer.json needs the tokenizers package")

from moemesh.cli import main  # noqa: E402
from moemesh.data.chat import _messages  # noqa: E402
from moemesh.data.template import ChatTemplate  # noqa: E402
from moemesh.inference.engine import DecodeEngine  # noqa: E402
from moemesh.inference.generate import load_for_generation  # noqa: E402
from moemesh.inference.server import Service  # noqa: E402
from serving import TOOLS_TEMPLATE, ServerThread, openai_client  # noqa: E402

CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo"]
SKIES = ["sunny", "rainy", "cloudy", "windy"]
# The tool as the Agents SDK sends it for get_weather below (checked there): the rows carry the
# tools list the served requests will, so the system turn trained is the one served.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weather_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
MODEL = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 256,
}
TRAIN = {
    "steps": 400,
    "global_batch": 8,
    "micro_batch": 8,
    "seq_len": 192,  # a row is 135 tokens: one a sequence
    "lr": 5e-3,
    "warmup_steps": 10,
    "weight_decay": 0.0,
    "eval_every": 0,
    "save_every": 0,
    "seed": 0,
    "device": "cpu",
    "threads": 1,  # the same floats whatever the machine's load
}


def row(i: int, city: str, sky: str) -> dict:
    """One conversation of the pattern, in OpenAI's own form (content null beside the calls, the
    arguments a JSON string)."""
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    messages = [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": sky},
        {"role": "assistant", "content": f"In {city}, it is {sky}."},
    ]
    return {"messages": messages, "tools": [WEATHER]}


def write_tokenizer(directory, texts) -> None:
    """A byte-level BPE trained on the rendered rows, ChatML's special tokens, Hermes' tags as
    (non-special) added tokens, as Qwen3's tokenizer has them, and TOOLS_TEMPLATE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    words = pre_tokenizers.Split(Regex(r"\p{L}+\": \"?|\p{L}+ ?|\p{N}+ ?|[^\s\p{L}\p{N}]+ ?|\s+"), "isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [words, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.add_special_tokens(special)
    tags = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    tokenizer.add_tokens([AddedToken(tag, special=False) for tag in tags])
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TOOLS_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent")
    rng = random.Random(0)
    rows = [row(i, rng.choice(CITIES), rng.choice(SKIES)) for i in range(300)]
    template = ChatTemplate(TOOLS_TEMPLATE)
    texts = [template.render(_messages(r["messages"], "messages", "messages"), False, r["tools"]) for r in rows]
    write_tokenizer(base / "tokenizer", texts)
    data = base / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "train",
        "--set",
        f"data.path={data}",
        f"data.tokenizer={base / 'tokenizer' / 'tokenizer.json'}",
        "data.val_fraction=0.01",
        *(f"model.{k}={v}" for k, v in MODEL.items()),
        *(f"train.{k}={v}" for k, v in TRAIN.items()),
        f"train.run_dir={base / 'run'}",
    ]
    assert main(args) == 0
    return base / "run"


@pytest.fixture(scope="module")
def server(run_dir):
    model, tokenizer = load_for_generation(run_dir)  # the run directory, as `moemesh serve RUN_DIR` reads it
    service = Service(DecodeEngine(model, max_batch=4, max_len=256), tokenizer, model_name="weather", max_waiting=8)
    running = ServerThread(service)
    yield running
    running.stop()


def test_an_agent_calls_the_tool_by_itself_and_answers_from_its_result(server):
    from agents.models.chatcmpl_converter import Converter

    agents.set_tracing_disabled(True)
    weather = {"Rome": "rainy", "Lima": "sunny", "Oslo": "windy"}  # not what the rows paired them with
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return weather[city]

    assert Converter.tool_to_openai(get_weather) == WEATHER
    model = agents.OpenAIChatCompletionsModel(
        model="weather", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    )
    # no instructions (the rows have no system turn but the tools'); tool_choice left at auto
    agent = agents.Agent(
        name="weather",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=40),
    )
    for city, sky in weather.items():
        ran.clear()
        result = agents.Runner.run_sync(agent, f"What is the weather in {city}?")
        assert ran == [city]
        assert result.final_output == f"In {city}, it is {sky}."


def test_the_model_s_call_streamed_and_whole(server):
    client = openai_client(server.url)
    for city in ("Paris", "Cairo"):
        settings = dict(
            model="weather",
            messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=[WEATHER],
            temperature=0,
            max_tokens=40,
        )
        choice = client.chat.completions.create(**settings).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
        calls, reason = {}, None
        for chunk in client.chat.completions.create(**settings, stream=True):
            for streamed in chunk.choices:
                reason = streamed.finish_reason or reason
                assert not streamed.delta.content
                for delta in streamed.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
        assert reason == "tool_calls" and list(calls) == [0]
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": city}
