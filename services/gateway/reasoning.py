"""Reasoning apart from the answer: a reply's ``<think>...</think>`` text becomes the message's
``reasoning_content`` (streamed as such deltas), the rest its ``content``.

Where the model thinks (Qwen3, DeepSeek-R1 and their kin), its reply opens with ``<think>``
or, when the chat template already wrote that tag at the end of the prompt (DeepSeek-R1's),
starts inside it. Everything before ``</think>`` is reasoning; a reply with no ``</think>`` is
all reasoning if it started inside one (cut off while thinking), else all content (a model
that did not think, e.g. Qwen3 with ``enable_thinking: false``). Tags split across deltas are
held until they are whole; a tag's own text is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.services.engine.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"


def parser_enabled(setting: str, tokenizer: Tokenizer) -> bool:
    """``auto``: where the vocabulary has both tags as tokens of their own; ``think`` (or
    vLLM's ``deepseek_r1``, ``qwen3``): always; ``none``: never."""
    if setting == "auto":
        return all(tokenizer.backend.token_to_id(tag) is not None for tag in (OPEN, CLOSE))
    return setting in ("think", "deepseek_r1", "qwen3")


def starts_in_reasoning(prompt_token_ids: Sequence[int], tokenizer: Tokenizer) -> bool:
    """The template opened a ``<think>`` the reply continues (the prompt ends with it, and
    perhaps a newline: DeepSeek-R1's)."""
    tail = tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


class ReasoningStream:
    """One choice's reply, fed as it streams: each feed gives (reasoning, content) to send."""

    def __init__(self, in_reasoning: bool) -> None:
        self._reasoning = in_reasoning
        self._started = in_reasoning  # past a <think> (or the prompt's)
        self._pending = ""  # text held: it may be the start of a tag
        self._opening = not in_reasoning  # the reply's first text may still open with <think>
        self._closed = False  # just past </think>: the newlines after it are dropped too

    @property
    def thought(self) -> bool:
        """The reply has reasoning (it opened with, or started inside, a <think>)."""
        return self._started

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self._pending + text
        self._pending = ""
        while text:
            if self._opening:
                stripped = text.lstrip()
                if OPEN.startswith(stripped):  # maybe the opening tag: wait for more
                    self._pending = text
                    break
                self._opening = False
                if stripped.startswith(OPEN):
                    self._reasoning = self._started = True
                    text = stripped[len(OPEN):]
                    continue
            if not self._reasoning:
                if self._closed:
                    text = text.lstrip("\n")
                    self._closed = not text
                content.append(text)
                break
            at = text.find(CLOSE)
            if at >= 0:
                reasoning.append(text[:at])
                self._reasoning, self._closed = False, True
                text = text[at + len(CLOSE):]
                continue
            held = _partial_tail(text, CLOSE)
            reasoning.append(text[:len(text) - held])
            self._pending = text[len(text) - held:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the reply's end."""
        pending, self._pending = self._pending, ""
        if self._reasoning:
            return pending, ""
        return "", pending


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole reply's reasoning (None: none) and content."""
    stream = ReasoningStream(in_reasoning)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.thought else None), content + more_content


def _partial_tail(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that may begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
