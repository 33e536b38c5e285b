"""The output parsers' cost (moemesh/inference/parsers/), a token's text at a time, as the HTTP
process pays it for every streamed chat token: microseconds a token for each format, on replies
of plain content, of reasoning then content, and of tool calls. CPU only (the parsers are pure
Python in the HTTP process); compare with the served tokens/s of bench/serve/serve_load.py: the
share of one core it takes is tokens/s x us/token / 1e6 (the issue's goal: under 1% of served
tokens/s at 64 streaming clients, measured beside a GPU run).

    PYTHONPATH=. python3 bench/serve/parse_cost.py            # every format
    PYTHONPATH=. python3 bench/serve/parse_cost.py --tokens-per-s 12000
"""

from __future__ import annotations

import argparse
import json
import time

from moemesh.inference.parsers.registry import output

WORDS = "the quick brown fox jumps over the lazy dog and then it runs back home again ".split(" ")
ARGS = json.dumps({"path": "src/main.py", "content": "def main():\n    return 0\n" * 20})
CALLS = {
    "hermes": "<tool_call>\n" + json.dumps({"name": "write", "arguments": json.loads(ARGS)}) + "\n</tool_call>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>write\n```json\n"
    + ARGS
    + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "mistral": "[TOOL_CALLS]write[ARGS]" + ARGS,
    "gemma4": '<|tool_call>call:write{path:<|"|>src/main.py<|"|>,n:3}<tool_call|>',
    "harmony": "<|channel|>analysis<|message|>"
    + " ".join(WORDS * 4)
    + "<|end|><|start|>assistant<|channel|>commentary to=functions.write <|constrain|>json<|message|>"
    + ARGS,
}
REASONING = {"hermes": "qwen3", "deepseek_v3": "deepseek_r1", "harmony": "harmony"}


def tokens(text: str, size: int = 4) -> list[str]:
    """The text in pieces of `size` characters (a token is ~4 characters of English)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def cost(make, text: str, repeat: int) -> float:
    """Microseconds a piece."""
    pieces = tokens(text)
    best = float("inf")
    for _ in range(repeat):
        parser = make()
        start = time.perf_counter()
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
        best = min(best, time.perf_counter() - start)
    return best / len(pieces) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tokens-per-s", type=float, help="served tokens/s (serve_load.py's) for the core's share")
    args = parser.parse_args()
    content = " ".join(WORDS * 40)
    print(f"{'format':<12} {'reply':<22} {'us/token':>9}" + ("  share of a core" if args.tokens_per_s else ""))
    for name, call in CALLS.items():
        reasoning = REASONING.get(name)
        rows = [("content", content), ("tool call", content[:200] + call)]
        if reasoning and name != "harmony":
            rows.append(("reasoning + content", "<think>" + content + "</think>" + content))
        for what, text in rows:
            us = cost(lambda: output(name, reasoning, tools=True, reasoning_open=False), text, args.repeat)  # noqa: B023
            share = f"  {args.tokens_per_s * us / 1e6:.2%}" if args.tokens_per_s else ""
            print(f"{name:<12} {what:<22} {us:>9.2f}{share}")


if __name__ == "__main__":
    main()
