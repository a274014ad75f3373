"""Speculative decoding: proposers guess k tokens, the target verifies them in one pass.

``proposer`` (the interface and the factory), ``ngram`` (prompt lookup), ``draft`` (a small
model or the target's first layers, with its own paged KV cache), ``policy`` (how many tokens
to draft, adapting to load and acceptance). Drafts are verified in ``engine/sampler.py``:
accepted while they equal the target's own draws.
"""
