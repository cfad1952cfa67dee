"""A tiny Llama model written as a GGUF file, so that engines which load GGUF only (llama.cpp) run the
same weights the tests run through transformers. Float32 tensors and no vocabulary (kvviz tokenizes;
llama.cpp only needs the vocabulary's size). Q and K rows are reordered as llama.cpp's converter does:
transformers rotates the two halves of each head, llama.cpp adjacent pairs."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers import PreTrainedModel

from .cache import cache_dir, publish_dir


def _pairs_first(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first half; second half] to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_gguf(model: PreTrainedModel, fingerprint: str) -> Path:
    """The model as a GGUF file in the kvviz cache (written once per weights' fingerprint)."""
    target = cache_dir() / "models" / f"export-{fingerprint[:16]}" / "model.gguf"
    if target.exists():
        return target
    cfg = model.config
    with publish_dir(target.parent) as out:
        w = gguf.GGUFWriter(str(out / target.name), "llama")
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
        w.add_vocab_size(cfg.vocab_size)
        w.add_tokenizer_model("none")
        sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
        w.add_tensor("output_norm.weight", sd["model.norm.weight"])
        w.add_tensor("output.weight", sd["lm_head.weight"])
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
            w.add_tensor(f"blk.{i}.attn_q.weight", _pairs_first(sd[p + "self_attn.q_proj.weight"],
                                                                cfg.num_attention_heads))
            w.add_tensor(f"blk.{i}.attn_k.weight", _pairs_first(sd[p + "self_attn.k_proj.weight"],
                                                                cfg.num_key_value_heads))
            w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
            w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
            w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                w.add_tensor(f"blk.{i}.ffn_{ours}.weight", sd[p + f"mlp.{theirs}.weight"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return target
