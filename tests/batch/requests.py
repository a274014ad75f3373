"""The batch tests' requests: short, greedy, mixed chat and completions, some sharing long
prefixes (a few prompt blocks each), so the prefix order and the prefix cache both matter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SYSTEMS = [f"You are assistant number {k}. You answer in one short sentence, plainly, without "
           f"lists, and you never ask a question back. Topic of the day: {topic}."
           for k, topic in enumerate(["rivers", "numbers", "cooking", "planets"])]
PREAMBLES = [f"Here is a list of facts about {topic}, one per line, each one short and true. "
             f"The list was written for a school quiz about {topic}.\nFact:"
             for topic in ["the sea", "trees", "music"]]


def batch_lines(count: int) -> list[dict[str, Any]]:
    """``count`` batch input lines: every third a completion, the rest chats; 4-8 tokens each."""
    lines = []
    for i in range(count):
        max_tokens = 4 + i % 5
        if i % 3 == 2:
            url = "/v1/completions"
            body: dict[str, Any] = {"prompt": f"{PREAMBLES[i % len(PREAMBLES)]} number {i} is",
                                    "max_tokens": max_tokens, "temperature": 0}
        else:
            url = "/v1/chat/completions"
            body = {"messages": [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                                 {"role": "user", "content": f"What is {i} plus {i % 7}?"}],
                    "max_tokens": max_tokens, "temperature": 0}
        lines.append({"custom_id": f"req-{i:03d}", "method": "POST", "url": url, "body": body})
    return lines


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
