"""A small checkpoint for the server tests: a tiny Qwen3-MoE with random weights, a byte-level BPE
tokenizer.json trained on a few lines (its special tokens never predicted: texts end by length or
stop strings), and a ChatML chat template in tokenizer_config.json; and a
`moemesh serve` whose engine runs in this process, on a thread (its HTTP server in the child
process it starts, on a real socket on 127.0.0.1)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Literal  # the agent's tool's annotation, resolved in this module

import torch

from moemesh.checkpoint.hf import save_pretrained
from moemesh.models import ModelConfig, build

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A Qwen3-like template: tools in the system turn, calls as Hermes <tool_call>s, tool results as
# <tool_response>s, and a thinking block the generation prompt opens with enable_thinking.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    '</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def write_checkpoint(directory: Path, chat_template: bool = True) -> Path:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["def main():\n    return 0\n", "the quick brown fox", "hello world"] * 20, trainer)
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    model = build(config, seed=3)
    with torch.no_grad():  # the special tokens' logits 0: a random model never ends a text on its own
        model.lm_head.weight[:3] = 0.0
    save_pretrained(model, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "bos_token": None}
    if chat_template:
        settings["chat_template"] = CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


class ServerThread:
    """`service.serve` on a thread, on a socket bound here (port chosen by the system)."""

    def __init__(self, service):
        self.service = service
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=service.serve, kwargs={"sock": self.sock}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not service.ready.is_set():
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.service.shutdown()
        self.thread.join(timeout=30)
        self.sock.close()


def forced_weather_agent(url: str, model_class: str) -> tuple[list[str], str]:
    """An openai-agents Agent (tracing off) over `model_class` ("OpenAIChatCompletionsModel" or
    "OpenAIResponsesModel") of the server at `url`, its @function_tool get_weather forced by
    tool_choice: the cities the tool ran with, and the agent's final output."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="answer",
        tools=[get_weather],
        model=getattr(agents, model_class)(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=30, temperature=1.0),
        tool_use_behavior="stop_on_first_tool",
    )
    return ran, agents.Runner.run_sync(agent, "weather in Rome?").final_output


def openai_client(url: str, api_key: str = "none"):
    """The official client of a served model at `url` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def serve_with_template(directory: Path, template: str):
    """A generator for a module fixture: the tiny checkpoint `directory` with its tokenizer's chat
    `template` (eos <|im_end|>), served in this process; yields the ServerThread, stops it after."""
    import json

    from moemesh.inference.engine import DecodeEngine
    from moemesh.inference.generate import load_for_generation
    from moemesh.inference.server import Service

    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    model, tokenizer = load_for_generation(directory)
    service = Service(DecodeEngine(model, max_batch=4, max_len=1024), tokenizer, model_name="tiny", max_waiting=16)
    running = ServerThread(service)
    yield running
    running.stop()
