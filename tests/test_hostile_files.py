"""Files that lie: every count and size a GGUF or safetensors header states, and every config field, is checked
before it is believed. Whatever the file says, loading ends at once with a `ModelFormatError` naming the field,
or succeeds; never a hang, a raw Python error or a MemoryError. Fuzzed with hypothesis (truncations, random
fields, huge counts); a longer campaign is under the slow marker."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vkgraph.nn import tiny_model as mk
from vkgraph.nn.config import ModelConfig, ModelFormatError
from vkgraph.nn.weights import expected_tensors, gguf_name, load_weights

CFG = mk.tiny_config(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16,
                     max_seq_len=64)

# GGUF metadata of CFG: key -> (value, GGUFValueType name)
META = {
    "general.architecture": ("llama", "STRING"), "llama.block_count": (1, "UINT32"),
    "llama.embedding_length": (8, "UINT32"), "llama.feed_forward_length": (16, "UINT32"),
    "llama.attention.head_count": (2, "UINT32"), "llama.attention.head_count_kv": (1, "UINT32"),
    "llama.context_length": (64, "UINT32"), "llama.rope.freq_base": (10000.0, "FLOAT32"),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32"), "llama.vocab_size": (16, "UINT32"),
}


def write_gguf(path: Path, meta: dict | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF of CFG's tensors (random float32) with the given metadata, through gguf's own writer."""
    from gguf import GGUFValueType, GGUFWriter

    meta = META if meta is None else meta
    if tensors is None:
        rng = np.random.default_rng(0)
        tensors = {gguf_name(n)[0]: rng.standard_normal(shape).astype(np.float32)
                   for n, (shape, _) in expected_tensors(CFG).items()}
    w = GGUFWriter(str(path), arch=None)
    for key, (value, vtype) in meta.items():
        sub = None
        if vtype.startswith("ARRAY:"):
            vtype, sub = "ARRAY", GGUFValueType[vtype[6:]]
        w.add_key_value(key, value, GGUFValueType[vtype], sub_type=sub)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf(d: Path, config: dict | None = None, raw_config: bytes | None = None) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    save_file({n: rng.standard_normal(shape).astype(np.float32) for n, (shape, _) in expected_tensors(CFG).items()},
              str(d / "model.safetensors"))
    (d / "config.json").write_bytes(raw_config if raw_config is not None else
                                    json.dumps(CFG.to_hf() if config is None else config).encode())
    return d


def load_quickly(path: Path, limit_s: float = 5.0):
    """load_weights, which must end within limit_s either way; returns the weights or the ModelFormatError."""
    t0 = time.perf_counter()
    try:
        out = load_weights(path, progress=False)
    except ModelFormatError as e:
        out = e
    assert time.perf_counter() - t0 < limit_s, f"loading took {time.perf_counter() - t0:.1f} s"
    return out


def fails_quickly(path: Path, words: str = "", limit_s: float = 2.0) -> None:
    got = load_quickly(path, limit_s)
    assert isinstance(got, ModelFormatError), "loaded"
    assert words in str(got), str(got)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    return {"gguf": write_gguf(d / "m.gguf"), "hf": write_hf(d / "hf")}


def test_the_small_files_load(good):
    for kind in ("gguf", "hf"):
        assert load_weights(good[kind], progress=False).config.n_layers == 1


# ---- the cases the probe found --------------------------------------------------------------------------------------

def test_a_huge_layer_count_fails_at_once(tmp_path):
    g = write_gguf(tmp_path / "m.gguf", META | {"llama.block_count": (10**8, "UINT32")})
    fails_quickly(g, "100000000 layers need more tensors than the 12 the file lists")
    fails_quickly(write_hf(tmp_path / "hf", CFG.to_hf() | {"num_hidden_layers": 10**8}), "100000000 layers")


def test_a_huge_context_length_builds_tables_for_the_context_asked_for(tmp_path):
    """context_length 2**31 died in numpy (16 GiB of RoPE tables); tables now follow the KV pool."""
    from vkgraph.nn.llama import LlamaModel

    path = mk.write_model(tmp_path, mk.tiny_config(n_layers=1, max_seq_len=2**31), gguf_types=("F32",),
                          safetensors=False)["F32"]
    w = load_weights(path, progress=False)
    assert w.config.max_seq_len == 2**31
    tracemalloc.start()
    try:
        model = LlamaModel(w, num_blocks=4, block_size=16, float_dtype="float32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.max_context == 64 and model.rope.cos.shape == (64, 8)
    assert peak < 4 << 20


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", 64.7, "hidden_size must be an integer >= 1, got 64.7"),
    ("hidden_size", "abc", "hidden_size must be an integer >= 1, got 'abc'"),
    ("hidden_size", None, "hidden_size is missing"),
    ("hidden_size", True, "hidden_size must be an integer"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer >= 1, got 0"),
    ("num_attention_heads", 3, "hidden_size 8 is not a multiple of num_attention_heads 3"),
    ("num_key_value_heads", -2, "num_key_value_heads must be an integer >= 1"),
    ("vocab_size", [16], "vocab_size must be an integer"),
    ("rope_theta", 0, "rope_theta must be a finite number > 1.0, got 0"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number"),
    ("rope_theta", float("inf"), "rope_theta must be a finite number"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps must be a finite number in (0.0, 1.0)"),
    ("rms_norm_eps", "small", "rms_norm_eps must be a finite number"),
    ("rope_scaling", "linear", "rope_scaling must be an object"),
    ("rope_scaling", {"rope_type": "linear"}, "rope_scaling.factor is missing"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor must be a finite number > 0.0"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4},
     "rope_scaling.high_freq_factor must be a finite number > 4.0"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("max_position_embeddings", 0, "max_position_embeddings must be an integer >= 1"),
    ("num_local_experts", -1, "num_local_experts must be an integer >= 0"),
])
def test_config_fields_are_checked_for_type_and_range(tmp_path, field, value, words):
    hf = {k: v for k, v in CFG.to_hf().items() if k != "head_dim"}  # derived: hidden_size / num_attention_heads
    d = write_hf(tmp_path, hf | {field: value})
    with pytest.raises(ModelFormatError, match=f"config.json: {_re(words)}"):
        load_weights(d, progress=False)


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{\"model_type\": \"llama\"", b"\xff\xfe{}", b"[" * 100000])
def test_unreadable_config_json(tmp_path, raw):
    with pytest.raises(ModelFormatError, match="config.json"):
        load_weights(write_hf(tmp_path, raw_config=raw), progress=False)


@pytest.mark.parametrize("key, value, words", [
    ("llama.rope.freq_base", (0.0, "FLOAT32"), "llama.rope.freq_base must be a finite number > 1.0"),
    ("llama.rope.freq_base", (float("nan"), "FLOAT32"), "llama.rope.freq_base must be a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", (-1.0, "FLOAT32"), "layer_norm_rms_epsilon must be a finite"),
    ("llama.embedding_length", ("abc", "STRING"), "llama.embedding_length must be an integer >= 1, got 'abc'"),
    ("llama.attention.head_count", (0, "UINT32"), "llama.attention.head_count must be an integer >= 1"),
    ("llama.attention.head_count", (3, "UINT32"), "not a multiple of llama.attention.head_count 3"),
    ("llama.rope.scaling.type", ("linear", "STRING"), "llama.rope.scaling.factor is missing"),
    ("llama.block_count", (-1, "INT32"), "llama.block_count must be an integer >= 1, got -1"),
    ("llama.context_length", (0, "UINT64"), "llama.context_length must be an integer >= 1"),
    ("general.architecture", (7, "UINT8"), "architecture 7 is not supported"),
])
def test_gguf_metadata_is_checked_for_type_and_range(tmp_path, key, value, words):
    meta = META | {key: value}
    with pytest.raises(ModelFormatError, match=_re(words)):
        load_weights(write_gguf(tmp_path / "m.gguf", meta), progress=False)


def test_a_zero_rope_factor_in_gguf(tmp_path):
    meta = META | {"llama.rope.scaling.type": ("linear", "STRING"), "llama.rope.scaling.factor": (0.0, "FLOAT32")}
    with pytest.raises(ModelFormatError, match="rope.scaling.factor must be a finite number > 0"):
        load_weights(write_gguf(tmp_path / "m.gguf", meta), progress=False)


def test_config_built_in_code_is_checked_too():
    import dataclasses

    for field, value in (("dim", 64.7), ("n_layers", "3"), ("norm_eps", -1.0), ("rope_theta", math.nan),
                         ("tie_embeddings", 1)):
        with pytest.raises(ModelFormatError, match=field):
            dataclasses.replace(CFG, **{field: value})


def _re(s: str) -> str:
    import re

    return re.escape(s)


# ---- huge counts in the binary header -----------------------------------------------------------------------------

_GGUF_COUNTS = {"tensor_count": 8, "kv_count": 16, "first_key_length": 24}  # byte offsets in the header


@pytest.mark.parametrize("where", ["tensor_count", "kv_count", "first_key_length"])
@pytest.mark.parametrize("value", [2**64 - 1, 2**40, 10**8])
def test_huge_counts_in_the_gguf_header(good, tmp_path, where, value):
    data = bytearray(good["gguf"].read_bytes())
    struct.pack_into("<Q", data, _GGUF_COUNTS[where], value)
    p = tmp_path / "m.gguf"
    p.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        fails_quickly(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(data) + (1 << 20)


def test_a_metadata_array_longer_than_the_file(tmp_path):
    """The gguf package's reader loops on empty reads past the end of the file for such an array."""
    meta = META | {"tokenizer.ggml.token_type": ([1, 2, 3], "ARRAY:INT32")}
    data = bytearray(write_gguf(tmp_path / "a.gguf", meta).read_bytes())
    i = data.index(b"tokenizer.ggml.token_type") + len("tokenizer.ggml.token_type") + 4 + 4  # type, item type
    assert struct.unpack_from("<Q", data, i)[0] == 3
    for n in (2**63, 10**9):
        struct.pack_into("<Q", data, i, n)
        (tmp_path / "b.gguf").write_bytes(bytes(data))
        fails_quickly(tmp_path / "b.gguf", "tokenizer.ggml.token_type")


def test_a_safetensors_header_length_past_the_file(good, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(good["hf"], d)
    data = bytearray((d / "model.safetensors").read_bytes())
    for n in (2**64 - 1, len(data), 1):
        struct.pack_into("<Q", data, 0, n)
        (d / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(ModelFormatError):
            load_weights(d, progress=False)


@pytest.mark.parametrize("entry, words", [
    ({"dtype": "F32", "shape": [8], "data_offsets": [0, 2**62]}, "truncated"),
    ({"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 32]}, "spans 32 bytes"),
    ({"dtype": "F32", "shape": [-8], "data_offsets": [0, 32]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [8], "data_offsets": [32, 0]}, "are not [begin, end]"),
    ({"dtype": "F32", "shape": "8", "data_offsets": [0, 32]}, "not a list"),
    ({"dtype": 5, "shape": [8], "data_offsets": [0, 32]}, "unknown dtype"),
    ({"shape": [8], "data_offsets": [0, 32]}, "lacks dtype"),
    ([1, 2], "lacks dtype"),
])
def test_malformed_safetensors_entries(good, tmp_path, entry, words):
    d = tmp_path / "hf"
    shutil.copytree(good["hf"], d)
    header = {"model.norm.weight": entry}
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    with pytest.raises(ModelFormatError, match=_re(words)):
        load_weights(d, progress=False)


# ---- fuzzing ---------------------------------------------------------------------------------------------------

def _truncations(path: Path, tmp: Path, offsets) -> None:
    data = path.read_bytes()
    cut = tmp / path.name
    for n in offsets:
        cut.write_bytes(data[:n])
        got = load_quickly(cut if path.suffix == ".gguf" else tmp)
        assert isinstance(got, ModelFormatError), n


def _header_end(path: Path) -> int:
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return int(GGUFReader(path).data_offset)
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _offsets(path: Path, every: bool) -> range | list[int]:
    """Every offset, or (the default run) every offset of a GGUF header (every 7th of a safetensors header's
    JSON text) and every 61st of the tensor data."""
    size, end = path.stat().st_size, _header_end(path)
    return range(size) if every else [*range(0, end, 1 if path.suffix == ".gguf" else 7), *range(end, size, 61)]


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_truncated_at_every_header_offset(good, tmp_path, kind):
    path = good["gguf"] if kind == "gguf" else good["hf"] / "model.safetensors"
    if kind != "gguf":
        shutil.copy(good["hf"] / "config.json", tmp_path)
    _truncations(path, tmp_path, _offsets(path, every=False))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_truncated_at_every_offset(good, tmp_path, kind):
    path = good["gguf"] if kind == "gguf" else good["hf"] / "model.safetensors"
    if kind != "gguf":
        shutil.copy(good["hf"] / "config.json", tmp_path)
    _truncations(path, tmp_path, _offsets(path, every=True))


_INT_TYPES = {"UINT8": (0, 2**8 - 1), "INT8": (-2**7, 2**7 - 1), "UINT16": (0, 2**16 - 1), "INT16": (-2**15, 2**15 - 1),
              "UINT32": (0, 2**32 - 1), "INT32": (-2**31, 2**31 - 1), "UINT64": (0, 2**64 - 1),
              "INT64": (-2**63, 2**63 - 1)}
_EDGE_INTS = [0, 1, 2, 3, 7, 8, 16, 2**31, 2**32 - 1, 10**8, 2**63 - 1, 2**64 - 1, -1, -(2**31)]


@st.composite
def gguf_values(draw):
    kind = draw(st.sampled_from([*_INT_TYPES, "FLOAT32", "FLOAT64", "BOOL", "STRING", "ARRAY"]))
    if kind in _INT_TYPES:
        lo, hi = _INT_TYPES[kind]
        v = draw(st.sampled_from([x for x in _EDGE_INTS if lo <= x <= hi]) | st.integers(lo, hi))
        return v, kind
    if kind in ("FLOAT32", "FLOAT64"):
        return draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e-30, 1e30, 0.5, 2.0])
                    | st.floats(width=32)), kind
    if kind == "BOOL":
        return draw(st.booleans()), kind
    if kind == "STRING":
        return draw(st.sampled_from(["llama", "qwen2", "linear", "none", ""]) | st.text(max_size=8)), kind
    sub = draw(st.sampled_from(["INT32", "UINT8", "FLOAT32", "STRING"]))
    if sub == "STRING":
        return draw(st.lists(st.text(max_size=4), max_size=4)), "ARRAY:STRING"
    if sub == "FLOAT32":
        return draw(st.lists(st.floats(width=32), max_size=4)), "ARRAY:FLOAT32"
    lo, hi = _INT_TYPES[sub]
    return draw(st.lists(st.integers(lo, hi), max_size=4)), f"ARRAY:{sub}"


_KEYS = [*META, "llama.attention.key_length", "llama.rope.dimension_count", "llama.expert_count",
         "llama.expert_used_count", "llama.rope.scaling.type", "llama.rope.scaling.factor", "general.alignment"]


def _write_changed_gguf(path: Path, meta: dict, changes) -> Path | None:
    """Writes `meta` with each (key, value) of `changes` set, or removed where value is None;
    None where the writer itself refuses the values."""
    meta = dict(meta)
    for key, value in changes:
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    try:
        return write_gguf(path, meta)
    except (ValueError, OverflowError, struct.error):  # values the writer itself refuses
        return None


def _fuzz_gguf_fields(tmp_path, changes) -> None:
    p = _write_changed_gguf(tmp_path / "f.gguf", META, changes)
    if p is not None:
        load_quickly(p)


_field_changes = st.lists(st.tuples(st.sampled_from(_KEYS), st.none() | gguf_values()), min_size=1, max_size=3)
_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_FUZZ_LONG = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(changes=_field_changes)
def test_fuzz_gguf_metadata_fields(tmp_path, changes):
    _fuzz_gguf_fields(tmp_path, changes)


@pytest.mark.slow
@_FUZZ_LONG
@given(changes=_field_changes)
def test_fuzz_gguf_metadata_fields_long(tmp_path, changes):
    _fuzz_gguf_fields(tmp_path, changes)


_HUGE = st.sampled_from([2**64 - 1, 2**63, 2**40, 2**32, 10**8, 4096, 0, 1]).map(lambda v: struct.pack("<Q", v))


def _fuzz_bytes(path: Path, tmp: Path, edits) -> None:
    data = bytearray(path.read_bytes())
    for frac, blob in edits:
        at = int(frac * (len(data) - 1))
        data[at:at + len(blob)] = blob
    out = tmp / path.name
    out.write_bytes(bytes(data))
    load_quickly(out if path.suffix == ".gguf" else tmp)


_byte_edits = st.lists(st.tuples(st.floats(0, 1), _HUGE | st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)
# most of a small file is tensor data: aim half of the edits at the header (the first 600 bytes)
_header_edits = st.lists(st.tuples(st.floats(0, 0.15), _HUGE | st.binary(min_size=1, max_size=8)), min_size=1,
                         max_size=4)


def test_a_gguf_string_that_is_not_utf8_is_named(good, tmp_path):
    # found by test_fuzz_gguf_bytes: one byte of the architecture's name made 0x80 escaped as a UnicodeDecodeError
    data = bytearray(good["gguf"].read_bytes())
    key = data.find(b"general.architecture")
    value = data.find(b"llama", key)  # after the key: the value's type and length, then its bytes
    assert key >= 0 and value > key
    data[value + 1] = 0x80
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    fails_quickly(tmp_path / "m.gguf", "general.architecture: a string that is not UTF-8")


@_FUZZ
@given(edits=_byte_edits | _header_edits)
def test_fuzz_gguf_bytes(good, tmp_path, edits):
    _fuzz_bytes(good["gguf"], tmp_path, edits)


@pytest.mark.slow
@_FUZZ_LONG
@given(edits=_byte_edits | _header_edits)
def test_fuzz_gguf_bytes_long(good, tmp_path, edits):
    _fuzz_bytes(good["gguf"], tmp_path, edits)


_json_values = st.recursive(st.none() | st.booleans() | st.sampled_from(_EDGE_INTS) | st.integers()
                            | st.floats() | st.text(max_size=6),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)
_ST_FIELDS = ["dtype", "shape", "data_offsets"]


def _fuzz_safetensors(good, tmp: Path, changes, header_len) -> None:
    d = tmp / "hf"
    if not d.exists():
        shutil.copytree(good["hf"], d)
    data = (good["hf"] / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    for i, field, value in changes:
        header[names[i % len(names)]][field] = value
    raw = json.dumps(header).encode()
    head = struct.pack("<Q", len(raw)) if header_len is None else header_len
    (d / "model.safetensors").write_bytes(head + raw + data[8 + n:])
    load_quickly(d)


_st_changes = st.lists(st.tuples(st.integers(0, 100), st.sampled_from(_ST_FIELDS), _json_values), max_size=3)


@_FUZZ
@given(changes=_st_changes, header_len=st.none() | _HUGE)
def test_fuzz_safetensors_header(good, tmp_path, changes, header_len):
    _fuzz_safetensors(good, tmp_path, changes, header_len)


@pytest.mark.slow
@_FUZZ_LONG
@given(changes=_st_changes, header_len=st.none() | _HUGE)
def test_fuzz_safetensors_header_long(good, tmp_path, changes, header_len):
    _fuzz_safetensors(good, tmp_path, changes, header_len)


_HF_KEYS = [*CFG.to_hf(), "rope_scaling", "num_local_experts", "num_experts_per_tok", "head_dim"]


def _fuzz_config(good, tmp: Path, changes) -> None:
    d = tmp / "hf"
    if not d.exists():
        shutil.copytree(good["hf"], d)
    cfg = CFG.to_hf()
    for key, value in changes:
        cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    got = load_quickly(d)
    if not isinstance(got, ModelFormatError):
        assert isinstance(got.config, ModelConfig)


_cfg_changes = st.lists(st.tuples(st.sampled_from(_HF_KEYS), _json_values), min_size=1, max_size=3)


@_FUZZ
@given(changes=_cfg_changes)
def test_fuzz_config_json(good, tmp_path, changes):
    _fuzz_config(good, tmp_path, changes)


@pytest.mark.slow
@_FUZZ_LONG
@given(changes=_cfg_changes)
def test_fuzz_config_json_long(good, tmp_path, changes):
    _fuzz_config(good, tmp_path, changes)


# ---- the tokenizer a GGUF carries (the command line reads it first) ---------------------------------------------

VOCAB = {"tokenizer.ggml.model": ("gpt2", "STRING"),
         "tokenizer.ggml.tokens": ([chr(ord("a") + i) for i in range(16)], "ARRAY:STRING"),
         "tokenizer.ggml.token_type": ([1] * 16, "ARRAY:INT32"),
         "tokenizer.ggml.bos_token_id": (0, "UINT32"), "tokenizer.ggml.eos_token_id": (1, "UINT32")}


def _load_tokenizer(path: Path):
    from vkgraph.nn.tokenizer import Tokenizer

    try:
        return Tokenizer.load(path)
    except ModelFormatError as e:
        return e


def test_the_gguf_vocabulary_loads(tmp_path):
    tok = _load_tokenizer(write_gguf(tmp_path / "m.gguf", META | VOCAB))
    assert tok.decode(tok.encode("abc")) == "abc"


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.tokens", (7, "INT32"), "tokenizer.ggml.tokens must be a list of str"),
    ("tokenizer.ggml.token_type", ([1, 1], "ARRAY:INT32"), "token_type must be a list of int of length 16"),
    ("tokenizer.ggml.bos_token_id", (99, "UINT32"), "bos_token_id must be a int in [0, 16)"),
    ("tokenizer.ggml.merges", (["ab"], "ARRAY:STRING"), "merges: a merge is not two tokens"),
    ("tokenizer.ggml.model", ([1], "ARRAY:INT32"), "tokenizer.ggml.model must be a str"),
])
def test_gguf_vocabulary_fields_are_checked(tmp_path, key, value, words):
    got = _load_tokenizer(write_gguf(tmp_path / "m.gguf", META | VOCAB | {key: value}))
    assert isinstance(got, ModelFormatError) and words in str(got), got


_VOCAB_KEYS = [*VOCAB, "tokenizer.ggml.merges", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
               "tokenizer.ggml.pre", "tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix"]
_vocab_changes = st.lists(st.tuples(st.sampled_from(_VOCAB_KEYS), st.none() | gguf_values()), min_size=1, max_size=3)


def _fuzz_vocab(tmp_path, changes) -> None:
    p = _write_changed_gguf(tmp_path / "v.gguf", META | VOCAB, changes)
    if p is not None:
        _load_tokenizer(p)


@_FUZZ
@given(changes=_vocab_changes)
def test_fuzz_gguf_vocabulary(tmp_path, changes):
    _fuzz_vocab(tmp_path, changes)


@pytest.mark.slow
@_FUZZ_LONG
@given(changes=_vocab_changes)
def test_fuzz_gguf_vocabulary_long(tmp_path, changes):
    _fuzz_vocab(tmp_path, changes)
