"""Incremental detokenization that never emits part of a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
gives U+FFFD. The text after a window of recent tokens is held back until a later token
completes the character. Decoding a few tokens of context before the new ones also keeps
tokenizers that drop a leading space on the first decoded token (SentencePiece) right.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.services.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this are emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        self._ids.append(token_id)
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back (a dangling partial character decodes as U+FFFD)."""
        prefix_text, full_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        full = decode(self._ids[self._prefix_offset:], self._skip_special)
        return prefix, full
