"""Builders the tests share: tokenizers with real chat templates, tiny random verifiers (>= 8 layers, so the default
aux layers [2, L//2, L-3] are distinct) and drafters, random slot batches. Fixtures live in conftest.py."""

from __future__ import annotations

import torch

from paradraft.data.vocab import build_vocab
from paradraft.models.checkpoint import build_drafter
from paradraft.models.common import DraftConfig
from paradraft.models.loss import SlotBatch

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# The structure of Qwen3's template: thinking kept only for assistant turns after the last user query.
QWEN3 = (
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"  # noqa: E501
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

CORPUS = [
    "The capital of France is Paris. Paris is a large city with many museums.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Hello! How are you today? I am fine, thank you very much.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Let me think step by step about the question and then answer it.",
] * 4

SPECIALS = {
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
}


def make_tokenizer(kind: str = "chatml", vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on a tiny corpus, with a real chat template of `kind`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    kw = {"chatml": dict(eos_token="<|im_end|>", bos_token=None, chat_template=CHATML),
          "llama3": dict(eos_token="<|eot_id|>", bos_token="<|begin_of_text|>", chat_template=LLAMA3),
          "qwen3": dict(eos_token="<|im_end|>", bos_token=None, chat_template=QWEN3)}[kind]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], **kw)
    hf.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in (kw["eos_token"],)]})
    return hf


def make_tiny_llama(vocab_size: int = 400, layers: int = 8, hidden: int = 64, seed: int = 0, qwen3: bool = False):
    """A tiny random Llama (or Qwen3) causal LM; 8 layers by default, so the default aux layers are distinct."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if qwen3:
        cfg = Qwen3Config(head_dim=hidden // 4, **common)
        return Qwen3ForCausalLM(cfg).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def save_tiny_verifier(tmp_path, kind: str = "chatml", qwen3: bool = False, seed: int = 0):
    """Write a tiny verifier (model + tokenizer) to a local directory and return its path."""
    tok = make_tokenizer(kind)
    model = make_tiny_llama(vocab_size=len(tok), qwen3=qwen3, seed=seed)
    path = tmp_path / f"verifier-{kind}{'-qwen3' if qwen3 else ''}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_drafter(algorithm="peagle", flavour="llama", layers=2, seed=0, verifier=None):
    torch.manual_seed(seed)
    verifier = verifier or make_tiny_llama(vocab_size=120, qwen3=(flavour == "qwen3"), seed=seed)
    cfg = DraftConfig.from_verifier(verifier.config, algorithm=algorithm, num_layers=layers, draft_vocab_size=60,
                                    mask_token_id=119 if algorithm == "peagle" else None)
    model = build_drafter(cfg)
    freqs = torch.randint(1, 100, (120,)).numpy()
    d2t, t2d = build_vocab(freqs, 60, 120)
    model.init_from_verifier(verifier, d2t, t2d)
    with torch.no_grad():  # a random but non-trivial drafter
        for n, p in model.named_parameters():
            if p.requires_grad and p.dim() >= 1 and "norm" not in n:
                p.normal_(0, 0.3)
    return model.eval(), verifier


def random_slots(T, model, doc_lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    doc = torch.zeros(T, dtype=torch.long)
    pos = torch.arange(T) + 1
    if doc_lengths:
        start = 0
        for i, n in enumerate(doc_lengths):
            doc[start:start + n] = i
            pos[start:start + n] = torch.arange(n) + 1
            start += n
    return SlotBatch(tokens=torch.randint(0, 118, (T,), generator=g),
                     hidden=torch.randn(T, 3 * cfg.hidden_size, generator=g), positions=pos, doc=doc,
                     target_p=torch.softmax(torch.randn(T, cfg.draft_vocab_size, generator=g), -1),
                     target_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
                     valid=torch.rand(T, generator=g) < 0.8)


def all_elements(T, K, doc=None):
    doc = torch.zeros(T, dtype=torch.long) if doc is None else doc
    a, d = [torch.arange(T)], [torch.zeros(T, dtype=torch.long)]
    for k in range(1, K):
        ok = torch.arange(T - k)
        ok = ok[doc[ok + k] == doc[ok]]
        a.append(ok)
        d.append(torch.full_like(ok, k))
    return torch.cat(a), torch.cat(d)


# the verifier families paradraft supports, as tiny random models: the fast runner's families, a padded vocabulary,
# mixtures of experts, GPT-OSS's sinks and sliding windows, and one family left to the generic adapter (Granite)
FAMILIES = ("llama", "qwen3_padded", "qwen3_moe", "gpt_oss", "granite")


def make_tiny_verifier(family: str, vocab_size: int = 120, layers: int = 8, hidden: int = 64, seed: int = 0):
    """A tiny random causal LM of `family` (>= 8 layers: distinct default aux layers), float32, eval mode.
    qwen3_padded has 16 embedding rows more than `vocab_size` tokens, as Qwen3's real vocabulary does."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if family in ("llama", "qwen3"):
        return make_tiny_llama(vocab_size, layers, hidden, seed, qwen3=family == "qwen3")
    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if family == "qwen3_padded":
        return make_tiny_llama(vocab_size + 16, layers, hidden, seed, qwen3=True)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(vocab_size=vocab_size, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                             num_experts=4, num_experts_per_tok=2, head_dim=hidden // 4, **common)
        return Qwen3MoeForCausalLM(cfg).eval()
    if family == "gpt_oss":
        cfg = GptOssConfig(vocab_size=vocab_size, intermediate_size=hidden, num_local_experts=4,
                           num_experts_per_tok=2, head_dim=hidden // 4, sliding_window=6,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
        model = GptOssForCausalLM(cfg).eval()
        with torch.no_grad():  # sinks that matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
        return model
    if family == "granite":
        cfg = GraniteConfig(vocab_size=vocab_size, intermediate_size=2 * hidden, embedding_multiplier=2.0,
                            residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.3, **common)
        return GraniteForCausalLM(cfg).eval()
    raise ValueError(family)


def drafter_for(verifier, algorithm: str, seed: int = 0, draft_vocab: int = 60):
    """A random but non-trivial drafter of `algorithm` for any verifier (draft vocabulary over its rows)."""
    torch.manual_seed(seed)
    rows = verifier.get_input_embeddings().weight.shape[0]
    cfg = DraftConfig.from_verifier(verifier.config, algorithm=algorithm, num_layers=2, draft_vocab_size=draft_vocab,
                                    mask_token_id=rows - 1 if algorithm == "peagle" else None,
                                    num_depths=8 if algorithm == "peagle" else None, vocab_size=rows)
    model = build_drafter(cfg)
    freqs = torch.randint(1, 100, (rows,)).numpy()
    d2t, t2d = build_vocab(freqs, draft_vocab, rows)
    model.init_from_verifier(verifier, d2t, t2d)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and p.dim() >= 1 and "norm" not in n:
                p.normal_(0, 0.3)
    return model.eval()


def send_json(handler, obj, status: int = 200) -> None:
    """Reply to an http.server request with a JSON body (the tests' small OpenAI-compatible servers)."""
    import json

    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
