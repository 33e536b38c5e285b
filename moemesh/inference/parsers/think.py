"""Reasoning between `<think>` and `</think>` (`--reasoning-parser qwen3` or `deepseek_r1`: the
same tags), returned apart from the answer (reasoning_content). Two starts:

- the template opened the block in the prompt (DeepSeek-R1's and the Qwen3 thinking models'
  generation prompts end with `<think>`): the reply is reasoning up to `</think>`;
- otherwise a reply that begins (after whitespace) with `<think>` opens it (Qwen3's hybrid
  models), and one that does not is all answer — `enable_thinking: false` renders an empty block
  in the prompt, so its reply has none.

A block never closed (max_tokens) is all reasoning. The whitespace between `</think>` and the
answer is dropped. Tool calls are read from the answer only (registry.Output feeds them the
content), never from the reasoning.
"""

from __future__ import annotations

from moemesh.inference.parsers.base import Event, Parser, held_suffix

OPEN, CLOSE = "<think>", "</think>"


def opened_in_prompt(prompt: str) -> bool:
    """Whether the rendered prompt leaves a thinking block open (its last tag is `<think>`)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class Think(Parser):
    def __init__(self, open_: bool = False):
        self.state = "reasoning" if open_ else "start"  # start | reasoning | after | content
        self.pending = ""

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.pending = "reasoning", stripped[len(OPEN) :]
                elif stripped and not OPEN.startswith(stripped):
                    self.state = "content"
                else:
                    return out
            elif self.state == "reasoning":
                at = self.pending.find(CLOSE)
                if at < 0:
                    cut = len(self.pending) - held_suffix(self.pending, (CLOSE,))
                    out.append(("reasoning", self.pending[:cut]))
                    self.pending = self.pending[cut:]
                    return out
                out.append(("reasoning", self.pending[:at]))
                self.state, self.pending = "after", self.pending[at + len(CLOSE) :]
            elif self.state == "after":
                stripped = self.pending.lstrip()
                if not stripped:
                    self.pending = ""
                    return out
                self.state, self.pending = "content", stripped
            else:
                out.append(("content", self.pending))
                self.pending = ""
        return out

    def finish(self) -> list[Event]:
        pending, self.pending = self.pending, ""
        if not pending or self.state == "after":
            return []
        return [("reasoning" if self.state == "reasoning" else "content", pending)]
