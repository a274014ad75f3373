"""Small helpers the engine tests share."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.outputs import RequestOutput
from tandem.services.protocol.request import GenerationRequest, SamplingParams


def chat(engine: LLMEngine, text: str) -> list[int]:
    """A one-message chat prompt, as the gateway renders it."""
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
        output: Sequence[int] = ()) -> list[int]:
    """One request to its end, stepping the engine; ``output``: tokens it made elsewhere
    (a resumed request), not repeated in the result."""
    return [t for out in outputs(engine, prompt, params, output) for t in out.new_token_ids]


def outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams,
            output: Sequence[int] = (), request_id: str = "r") -> list[RequestOutput]:
    """``run``'s request, as the engine's outputs."""
    engine.add_request(GenerationRequest(request_id, prompt, params,
                                         output_token_ids=tuple(output)))
    found: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        found += [out for out in engine.step() if out.request_id == request_id]
    return found


def tiny_qwen3_moe(num_layers: int = 3, sparse_step: int = 1,
                   mlp_only_layers: Sequence[int] = (1,), norm_topk_prob: bool = True):  # type: ignore[no-untyped-def]
    """A random-weight transformers Qwen3-MoE of ``num_layers`` layers (8 experts, 2 a token;
    dense MLPs in ``mlp_only_layers`` and off ``sparse_step``), in eval mode, float32."""
    import torch
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers),
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
        initializer_range=0.2)
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(config).eval()


def assert_matches_teacher_forced(hf, prompt: list[int], tokens: list[int],  # type: ignore[no-untyped-def]
                                  logprobs: list[float]) -> None:
    """Greedy ``tokens`` with their ``logprobs`` after ``prompt`` against a teacher-forced
    transformers pass of ``hf`` over the same tokens: logprobs within 1e-4, each token the
    argmax up to a genuine near-tie."""
    import torch

    assert len(tokens) == len(logprobs) > 0
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]])
        ref = hf(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    ref_lp = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), ref_lp, atol=1e-4, rtol=0)
    assert bool((ref.max(-1).values - ref_lp < 1e-3).all())
