"""Write a model as a Hugging Face directory, read by our own loader: for peers that take one.

    python -m tandem.loadtest.export_hf --out models/smollm2-hf               # the built-in model
    python -m tandem.loadtest.export_hf --model path/to/model.gguf --out DIR --dtype bfloat16

vLLM's CPU backend and transformers serve the same weights as Tandem from this directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json): the weights exactly as our engine uses them (GGUF dequantised, Q/K
rows un-permuted), the tokenizer our gateway encodes with, the chat template it renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from tandem.services.engine.model_loader import LoadedModel, load_model

PROG = "python -m tandem.loadtest.export_hf"


def hf_config(model: LoadedModel, dtype: str) -> dict[str, Any]:
    c = model.config
    if c.qk_norm or c.attention_bias or c.gemma:
        has = "Gemma layers" if c.gemma else "q/k norms" if c.qk_norm else "q/k/v biases"
        raise ValueError(f"{c.model_id}: only Llama-architecture models are exported "
                         f"(this one has {has})")
    eos = list(c.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "torch_dtype": dtype,
    }


def export(model: LoadedModel, out: Path, dtype: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(model, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: tensor.contiguous() for name, tensor in model.weights.items()
               if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = model.tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
        "add_bos_token": tokenizer.add_bos, "add_eos_token": False,
        "chat_template": tokenizer.chat_template,
        "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
    }, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or a Hugging Face directory (default: the "
                                   "built-in SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        export(load_model(args.model, args.dtype, progress=False), args.out, args.dtype)
    except ValueError as exc:
        p.error(str(exc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
