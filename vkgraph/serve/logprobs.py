"""Log-probabilities in OpenAI's two shapes: the completions one (tokens, token_logprobs, top_logprobs,
text_offset) and the chat one (content: a list of {token, logprob, bytes, top_logprobs}).

A token is named by its own bytes: as text where they are valid UTF-8, else as "bytes:\\xe2\\x80" (OpenAI's way
for a token that holds part of a character); the chat shape also gives the bytes as a list of ints.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..nn.engine import Event, TokenLogprob
from ..nn.tokenizer import IncrementalDecoder, Tokenizer

_FLOOR = -9999.0  # JSON has no -inf: a log-probability that underflowed is reported as this, as vLLM does
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others are shifted
    past 255 (the inverse of the map byte-level BPE vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


class TokenNames:
    """The bytes and display string of each token id of a tokenizer (cached per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers import decoders

        self.tok = tokenizer.tok
        self.byte_level = isinstance(self.tok.decoder, decoders.ByteLevel)
        self.added = {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._token_bytes(token)
        return b

    def _token_bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode()
        piece = self.tok.id_to_token(token)
        if piece is None:
            return b""
        if self.byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        if not self.byte_level:  # SentencePiece marks a space with U+2581
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([token], skip_special_tokens=False).encode()

    def name(self, token: int) -> str:
        b = self.bytes(token)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _lp(v: float) -> float:
    return max(v, _FLOOR)


class CompletionLogprobs:
    """The completions shape for one choice, built token by token. `text_offset` is where each token's text
    starts in the completion's text (as decoded so far, token by token)."""

    def __init__(self, names: TokenNames, tokenizer: Tokenizer) -> None:
        self.names = names
        self.decoder = IncrementalDecoder(tokenizer)
        self.length = 0  # characters decoded so far

    def add(self, events: list[Event]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ev in events:
            lp = _need(ev)
            out["tokens"].append(self.names.name(ev.token))
            out["token_logprobs"].append(_lp(lp.logprob))
            # OpenAI's rule: the sampled token is always among them, so there may be logprobs + 1
            top = {self.names.name(t): _lp(v) for t, v in lp.top}
            top.setdefault(self.names.name(ev.token), _lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.length)
            self.length += len(self.decoder.push(ev.token))
        return out


def chat_logprobs(names: TokenNames, events: list[Event]) -> dict:
    """The chat shape for these tokens: top_logprobs holds exactly the alternatives asked for."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": names.name(token), "logprob": _lp(logprob), "bytes": list(names.bytes(token))}

    content = []
    for ev in events:
        lp = _need(ev)
        content.append(entry(ev.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]})
    return {"content": content, "refusal": None}


def _need(ev: Event) -> TokenLogprob:
    if ev.logprobs is None or ev.token is None:
        raise ValueError(f"event of request {ev.request_id} carries no log-probability")
    return ev.logprobs
