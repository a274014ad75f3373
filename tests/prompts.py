"""The prompt set every correctness test uses: 8 prompts of 10 to ~1,000 tokens, chat and raw.

Built from text that ships with Python so the set is deterministic and needs no download.
"""

from __future__ import annotations

import inspect
import json
import textwrap

from tandem.services.engine.tokenizer import Tokenizer

_JSON_DOC = json.__doc__ or ""


def _source_tokens(tokenizer: Tokenizer, module: object, n: int) -> list[int]:
    return tokenizer.encode(inspect.getsource(module))[:n]  # type: ignore[arg-type]


def prompt_set(tokenizer: Tokenizer) -> list[list[int]]:
    chat = tokenizer.encode_chat
    prompts = [
        tokenizer.encode("Here is a list of the five largest cities in Europe by population:"),
        chat([{"role": "user", "content": "What is the capital of France?"}]),
        chat([{"role": "system", "content": "You are a terse assistant."},
              {"role": "user", "content": "Write a haiku about paged memory."}]),
        tokenizer.encode(_JSON_DOC[:700]),
        chat([{"role": "user", "content": "Summarise this text in two sentences:\n\n"
               + (textwrap.__doc__ or "") + _JSON_DOC[:400]}]),
        _source_tokens(tokenizer, json.decoder, 480),
        chat([{"role": "user", "content": "Explain what this code does:\n\n"
               + inspect.getsource(textwrap.TextWrapper._wrap_chunks)}]),
        _source_tokens(tokenizer, textwrap, 1000),
    ]
    return prompts


def shared_prefix_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """8 prompts sharing a ~600-token prefix (a long system prompt), with short suffixes."""
    system = "You answer questions about this module.\n\n" + inspect.getsource(json.encoder)
    prefix = tokenizer.encode(system)[:600]
    questions = ["What does it escape?", "Name one class.", "Is it fast?", "Who wrote it?",
                 "What is c_make_encoder?", "Summarise it.", "What is INFINITY?", "List imports."]
    return [prefix + tokenizer.encode("\n\nQuestion: " + q + "\nAnswer:") for q in questions]
