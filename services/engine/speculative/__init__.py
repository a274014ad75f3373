"""Speculative decoding: proposers guess k tokens, the target verifies them in one pass.

``proposer`` (the interface and the factory), ``ngram`` (prompt lookup), ``draft`` (a small
model or the target's first layers, with its own paged KV cache), ``acceptance`` (greedy and
rejection sampling), ``policy`` (how many tokens to draft, adapting to load and acceptance).
"""
