"""Tokenizers from tokenizer.json and from GGUF's embedded vocabulary agree; special ids, streaming decode."""

from __future__ import annotations

import pytest

from vkgraph.nn import tiny_model as mk
from vkgraph.nn.config import UnsupportedModelError
from vkgraph.nn.tokenizer import Tokenizer

TEXTS = ["Hello world! The capital of France is Paris.", "  spaces\tand\nnewlines  ", "ünïcödé, 日本語 and 😀🚀",
         "numbers 1234567 3.14", "<|eot_id|> inside text", ""]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return mk.write_model(tmp_path_factory.mktemp("tok"), mk.tiny_config(vocab_size=320), gguf_types=("F32",))


@pytest.fixture(scope="module", params=["json", "gguf"])
def tok(request, paths):
    return Tokenizer.load(paths["hf"] if request.param == "json" else paths["F32"])


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0
    assert tok.decode(ids) == text.replace("<|eot_id|>", "")  # special tokens are skipped by default
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_gguf_vocabulary_encodes_like_tokenizer_json(paths):
    a, b = Tokenizer.load(paths["hf"]), Tokenizer.load(paths["F32"])
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
    assert a.vocab_size == b.vocab_size == 320
    assert a.eos_ids == b.eos_ids == (1, 2) and a.eos_id == 1


def test_merges_are_used(tok):
    ids = tok.encode("The capital of France", add_special_tokens=False)
    assert len(ids) < len("The capital of France")  # BPE merged some bytes
    assert max(ids) >= 3 + 256  # merged tokens come after the specials and the byte alphabet


def test_special_tokens(tok):
    ids = tok.encode("a<|eot_id|>b", add_special_tokens=False)
    assert 2 in ids
    assert tok.decode(ids, skip_special_tokens=False) == "a<|eot_id|>b"
    assert tok.decode([319], skip_special_tokens=False) == "<|reserved_special_token_19|>"


def test_stream_decoding_holds_back_partial_characters(tok):
    text = "tiny 😀 model: ünï 日本"
    ids = tok.encode(text, add_special_tokens=False)
    s = tok.stream()
    pieces = [s.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji spans several byte tokens: nothing is emitted until it is whole


def test_llama3_pre_tokenizer_splits_digits_in_threes(paths, tmp_path):
    from tokenizers import pre_tokenizers

    tok = Tokenizer.load(paths["F32"])
    assert isinstance(tok.tok.pre_tokenizer, pre_tokenizers.ByteLevel)  # "gpt-2" pre-tokenizer as written
    gguf = _rewrite_gguf_tokenizer(paths["F32"], tmp_path / "l3.gguf", pre="llama-bpe")
    pieces = [p for p, _ in Tokenizer.load(gguf).tok.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == ["123", "456", "7"]


def test_sentencepiece_gguf_is_rejected_clearly(paths, tmp_path):
    gguf = _rewrite_gguf_tokenizer(paths["F32"], tmp_path / "spm.gguf", model="llama")
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        Tokenizer.load(gguf)


def test_model_files_are_deterministic(paths, tmp_path):
    again = mk.write_model(tmp_path / "again", mk.tiny_config(vocab_size=320), gguf_types=("F32",))
    for f in ("tokenizer.json", "config.json", "model.safetensors", "model-f32.gguf"):
        assert (paths["hf"] / f).read_bytes() == (again["hf"] / f).read_bytes(), f
    other = mk.write_model(tmp_path / "other", mk.tiny_config(vocab_size=320), seed=1, gguf_types=())
    assert (other["hf"] / "model.safetensors").read_bytes() != (paths["hf"] / "model.safetensors").read_bytes()


def _rewrite_gguf_tokenizer(src, dst, **changes: str):
    """A copy of a GGUF file's tokenizer metadata (no tensors) with tokenizer.ggml.<key> strings replaced."""
    from gguf import GGUFWriter

    from vkgraph.nn.config import gguf_value
    from vkgraph.nn.weights import open_gguf

    r = open_gguf(src)
    w = GGUFWriter(str(dst), "llama")
    w.add_tokenizer_model(changes.get("model", gguf_value(r, "tokenizer.ggml.model")))
    w.add_tokenizer_pre(changes.get("pre", gguf_value(r, "tokenizer.ggml.pre")))
    w.add_token_list(gguf_value(r, "tokenizer.ggml.tokens"))
    w.add_token_types(gguf_value(r, "tokenizer.ggml.token_type"))
    w.add_token_merges(gguf_value(r, "tokenizer.ggml.merges"))
    w.add_eos_token_id(gguf_value(r, "tokenizer.ggml.eos_token_id"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return dst
