"""Small randomly initialised decoders with a fixed seed: real architectures, test-sized.

They need no download, so the test suite and the UI work offline; a byte-level tokenizer means any
text (the Chinese colour words included) round-trips through them.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

from ..util.byte_level import CHAR_TO_BYTE

EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOS
SEED = 0


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0-255 are the byte values) plus an EOS token (id 256)."""
    vocab = CHAR_TO_BYTE
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": EOS})
    assert fast.eos_token_id == VOCAB_SIZE - 1
    return fast


TINY_CONFIGS = {
    "tiny-llama": lambda: LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=VOCAB_SIZE - 1, bos_token_id=None, pad_token_id=None, initializer_range=0.1,
        tie_word_embeddings=False,
    ),
    "tiny-gpt2": lambda: GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
        eos_token_id=VOCAB_SIZE - 1, bos_token_id=VOCAB_SIZE - 1, initializer_range=0.1,
    ),
}


def tiny_model(name: str) -> torch.nn.Module:
    """The named tiny model, initialised from a fixed seed without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(TINY_CONFIGS[name](), dtype=torch.float32)
