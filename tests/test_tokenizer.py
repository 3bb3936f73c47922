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


PRE_TEXTS = TEXTS + ["Hello world! 12345 abc", "  lots   of  spaces\n\n\tand 1,234,567.89", "don't I'LL we've",
                     "x=1_000;y=22", "once upon a time 2024, 2025 and 2026"] + mk.CORPUS.splitlines()


def _vocabulary_gguf(dst, pre: str):
    """A GGUF file holding only a byte-level BPE vocabulary trained across word, digit and space boundaries (so the
    pre-tokenizer decides which merges may apply), with tokenizer.ggml.pre set to `pre`."""
    import json

    from gguf import GGUFWriter
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.train_from_iterator(PRE_TEXTS * 4, trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(t.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    w = GGUFWriter(str(dst), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if tok == "<|end_of_text|>" else 1 for tok in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_eos_token_id(model["vocab"]["<|end_of_text|>"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return dst


@pytest.mark.slow
def test_pre_tokenizers_split_as_transformers_reads_them(tmp_path):
    """For each pre-tokenizer transformers' GGUF reader knows (GPT-2's, Llama 3's, Qwen2's), vkgraph's GGUF tokenizer
    gives the ids transformers gives on the same vocabulary; the three give different ids (the vocabulary's merges
    cross the boundaries they draw), so a wrong split would show. Needs the `reference` extra."""
    transformers = pytest.importorskip("transformers")
    seen = set()
    for pre in ("gpt-2", "llama-bpe", "qwen2"):
        gguf = _vocabulary_gguf(tmp_path / f"{pre}.gguf", pre)
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
        vk = Tokenizer.load(gguf)
        ids = [vk.encode(t, add_special_tokens=False) for t in PRE_TEXTS]
        assert ids == [hf(t, add_special_tokens=False).input_ids for t in PRE_TEXTS], pre
        seen.add(str(ids))
    assert len(seen) == 3


def test_unknown_tokenizer_model_is_rejected_clearly(paths, tmp_path):
    gguf = _rewrite_gguf_tokenizer(paths["F32"], tmp_path / "bert.gguf", model="bert")
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported.*tokenizer.json"):
        Tokenizer.load(gguf)


# ---- SentencePiece vocabularies (tokenizer.ggml.model "llama"), against a port of llama.cpp's tokenizer -----------

SPM_TEXTS = ["Hello world! The capital of France is Paris.", "The lazy dog did not mind.", "  two  spaces,\nnew line",
             "ünïcödé 日本 😀 zzq", "one two three, 1 2 3.", "Vulkan compute shaders read weights"]


def llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm on one fragment: characters as symbols, repeatedly merge the adjacent pair
    whose concatenation is the best-scoring token (leftmost on ties), then byte fallback for what is left."""
    import heapq

    syms = list(("\u2581" + text).replace(" ", "\u2581"))
    nxt = list(range(1, len(syms))) + [-1]
    prv = list(range(-1, len(syms) - 1))
    heap: list[tuple[float, int, str]] = []

    def bigram(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and syms[left] + syms[right] in vocab:
            t = syms[left] + syms[right]
            heapq.heappush(heap, (-scores[vocab[t]], left, t))

    for i in range(len(syms) - 1):
        bigram(i, i + 1)
    while heap:
        _, left, t = heapq.heappop(heap)
        right = nxt[left]
        if right < 0 or not syms[left] or syms[left] + syms[right] != t:
            continue  # stale: one side was merged since
        syms[left], syms[right] = t, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    out, i = [], 0
    while i >= 0:
        if syms[i] in vocab:
            out.append(vocab[syms[i]])
        else:
            out += [vocab[f"<0x{b:02X}>"] for b in syms[i].encode()]
        i = nxt[i]
    return out


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A SentencePiece-style GGUF vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces trained on the tiny
    model's corpus, each scored by its training order (as Llama's are)."""
    from gguf import GGUFWriter
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(mk.CORPUS.splitlines(), vocab_size=400, min_frequency=1, show_progress=False)
    pieces = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path, {t: i for i, t in enumerate(tokens)}, scores


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_encodes_as_llama_cpp_does(spm_gguf, text):
    path, vocab, scores = spm_gguf
    tok = Tokenizer.load(path)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1  # llama.cpp adds BOS to SentencePiece vocabularies by default
    assert ids[1:] == llama_cpp_spm(text, vocab, scores)
    assert tok.decode(ids) == text
    assert tok.eos_ids == (2,)


def test_sentencepiece_merges_and_byte_fallback(spm_gguf):
    path, vocab, _ = spm_gguf
    tok = Tokenizer.load(path)
    ids = tok.encode("The capital 😀", add_special_tokens=False)
    assert vocab["\u2581The"] in ids or vocab.get("\u2581capital") in ids  # whole pieces
    assert [vocab["<0xF0>"], vocab["<0x9F>"], vocab["<0x98>"], vocab["<0x80>"]] == ids[-4:]  # the emoji as bytes
    s = tok.stream()
    assert "".join(s.push(i) for i in ids) + s.flush() == "The capital 😀"


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
    from vkgraph.nn.model_file import open_gguf

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
