"""The generation engine: continuous batching over a paged KV cache with prefix caching, GPU sampling,
stop conditions and streaming.

Each `step()` admits waiting requests while KV blocks last (their prompts are computed together in one pass,
minus any prefix already cached, and their first tokens sampled), then runs one decode step for every running
request, as one replay of a captured step (vkgraph.jit) per batch-size bucket. Requests join and leave between
steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..jit import jit
from ..tensor import Tensor, manual_seed
from .kv_cache import KVCacheManager, OutOfKVBlocks
from .layers import StepInputs
from .llama import LlamaModel
from .sampling import SamplingParams, SamplingTensors, sample
from .tokenizer import Tokenizer


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    output: list[int] = field(default_factory=list)
    text: str = ""
    finished: str | None = None  # "stop", "length" or "abort" once done
    cached_prompt_tokens: int = 0
    text_cut: bool = False  # a stop string ended the text


@dataclass
class Event:
    """One streamed piece of output."""

    request_id: int
    token: int
    text: str
    finished: str | None


class Engine:
    """Serve many requests on one model. `generate()` streams; `step()` advances every request by a token."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None = None, *, max_batch: int = 32,
                 prefix_caching: bool = True, seed: int = 0, max_prefill_tokens: int = 4096) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens computed in one admission pass
        self.kv = KVCacheManager(model.caches[0].num_blocks, model.block_size, prefix_caching=prefix_caching)
        self.vocab = model.config.vocab_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.ids = itertools.count()
        self.decoders: dict[int, object] = {}
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "decode_tokens": 0, "decode_steps": 0}
        manual_seed(seed)
        self._decode = jit(self._decode_step, max_entries=16)

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, max_tokens: int = 64,
                    stop: Sequence[str] = (), stop_token_ids: Sequence[int] | None = None) -> int:
        ids = self._encode(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) + max_tokens > self.model.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                             f"of {self.model.max_context} tokens")
        if max(ids) >= self.vocab or min(ids) < 0:
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        eos = set(stop_token_ids if stop_token_ids is not None else
                  (self.tokenizer.eos_ids if self.tokenizer is not None else ()))
        req = Request(next(self.ids), ids, params or SamplingParams(), max_tokens, frozenset(eos), tuple(stop))
        self.waiting.append(req)
        return req.id

    def abort(self, request_id: int) -> None:
        for group in (self.waiting, self.running):
            for r in list(group):
                if r.id == request_id:
                    group.remove(r)
                    r.finished = "abort"
                    if r.id in self.kv.seqs:
                        self.kv.free_sequence(r.id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                 **kwargs: object) -> Iterator[Event]:
        """Add the prompts and stream events until all are finished."""
        for p in prompts:
            self.add_request(p, params, **kwargs)
        while self.has_work():
            yield from self.step()

    # ---- one step -----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self._admit()
        if self.running:
            events += self._decode_running()
        return events

    def _admit(self) -> list[Event]:
        """Admit waiting requests while KV blocks and batch rows last, and prefill them in one forward pass."""
        admitted: list[tuple[Request, int]] = []
        pending_tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            if admitted and pending_tokens + len(req.prompt) > self.max_prefill_tokens:
                break
            try:
                cached = self.kv.add_sequence(req.id, req.prompt)
            except OutOfKVBlocks:
                if not self.running and not admitted:
                    raise  # nothing will ever free a block: the request cannot fit at all
                break  # wait for running requests to finish
            self.waiting.pop(0)
            req.cached_prompt_tokens = cached
            self.stats["prompt_tokens"] += len(req.prompt)
            self.stats["cached_prompt_tokens"] += cached
            pending_tokens += len(req.prompt) - cached
            admitted.append((req, cached))
        if not admitted:
            return []
        reqs = [r for r, _ in admitted]
        logits = self._prefill(reqs, continue_cached=any(c for _, c in admitted))
        for r in reqs:
            self.kv.mark_computed(r.id)
        tokens = self._sample(logits, reqs)
        events = []
        for r, t in zip(reqs, tokens):
            self.running.append(r)
            events.append(self._emit(r, int(t)))
        return events

    def _prefill(self, reqs: list[Request], continue_cached: bool) -> Tensor:
        """Logits (len(reqs), vocab) of each prompt's last token, computing only tokens not already cached.

        Token rows are padded to a power of two (at least 16): prompts of similar length then share one set of
        compiled kernels and one cached schedule. Padding rows write no KV (slot -1) and are never read."""
        ids = [r.id for r in reqs]
        real = sum(self.kv.context_len(i) - self.kv.num_computed(i) for i in ids)
        rows = _pow2(max(real, 16))
        meta = self.kv.batch(ids, width=self.model.max_blocks_per_seq, pad_tokens=rows)
        qsl = meta.query_start_loc
        counts = np.diff(qsl)
        common = dict(positions=Tensor(meta.positions), slot_mapping=Tensor(meta.slot_mapping))
        if not continue_cached:
            step = StepInputs(**common, cu_seqlens=Tensor(qsl), max_seq_len=int(counts.max()))
        else:  # some continue a cached prefix: each new token is a query row over the paged cache
            tables = np.zeros((rows, meta.block_tables.shape[1]), np.int32)
            tables[:real] = np.repeat(meta.block_tables, counts, axis=0)
            step = StepInputs(**common, block_tables=Tensor(tables), context_lens=Tensor(meta.positions + 1))
        return self.model(Tensor(meta.input_ids), step, logit_rows=Tensor((qsl[1:] - 1).astype(np.int32)))

    def _decode_running(self) -> list[Event]:
        reqs = self.running
        rows = _bucket(len(reqs), self.max_batch)
        meta = self.kv.batch([r.id for r in reqs], width=self.model.max_blocks_per_seq, pad_seqs=rows,
                             pad_tokens=rows)
        st = SamplingTensors.build([r.params for r in reqs], rows, self.vocab)
        presence = self._presence(reqs, rows)
        noise = self._noise(st, rows)
        tokens = self._decode(Tensor(meta.input_ids), Tensor(meta.positions), Tensor(meta.slot_mapping),
                              Tensor(meta.block_tables), Tensor(meta.context_lens), st.temperature, st.top_k, st.top_p,
                              st.min_p, st.penalty, presence, noise, st.use_top_k, st.use_top_p,
                              st.use_sampling).numpy()
        self.stats["decode_steps"] += 1
        events = []
        for r, t in zip(list(reqs), tokens[:len(reqs)]):
            self.kv.mark_computed(r.id)
            events.append(self._emit(r, int(t)))
        return events

    def _decode_step(self, ids, positions, slots, tables, ctx, temperature, top_k, top_p, min_p, penalty, presence,
                     noise, use_top_k, use_top_p, use_sampling):
        step = StepInputs(positions=positions, slot_mapping=slots, block_tables=tables, context_lens=ctx)
        logits = self.model(ids, step)
        st = SamplingTensors(temperature, top_k, top_p, min_p, penalty, use_top_k, use_top_p, use_sampling)
        return sample(logits, st, presence, noise)

    def _sample(self, logits: Tensor, reqs: list[Request]) -> np.ndarray:
        st = SamplingTensors.build([r.params for r in reqs], len(reqs), self.vocab)
        return sample(logits, st, self._presence(reqs, len(reqs)), self._noise(st, len(reqs))).numpy()

    def _noise(self, st: SamplingTensors, rows: int) -> Tensor:
        """Uniform noise for the Gumbel draw; a (rows, 1) placeholder when every row is greedy (no vocabulary-
        sized random kernel per step)."""
        return Tensor.rand(rows, self.vocab) if st.use_sampling else Tensor(np.zeros((rows, 1), np.float32))

    def _presence(self, reqs: list[Request], rows: int) -> Tensor:
        """Tokens each request has seen, for the repetition penalty; a (rows, 1) zero column (broadcast, and no
        vocabulary-sized upload every step) when no request uses the penalty."""
        if all(r.params.repetition_penalty == 1.0 for r in reqs):
            return Tensor(np.zeros((rows, 1), np.float32))
        mask = np.zeros((rows, self.vocab), np.float32)
        for i, r in enumerate(reqs):
            if r.params.repetition_penalty != 1.0:
                mask[i, r.prompt] = 1.0
                mask[i, r.output] = 1.0
        return Tensor(mask)

    # ---- output and stopping ------------------------------------------------------------------------------
    def _emit(self, req: Request, token: int) -> Event:
        req.output.append(token)
        self.stats["decode_tokens"] += 1
        piece = ""
        dec = None
        if self.tokenizer is not None:
            dec = self.decoders.setdefault(req.id, self.tokenizer.stream())
            piece = dec.push(token)
            req.text += piece
        if token in req.stop_ids:
            req.finished = "stop"
        elif any(s in req.text for s in req.stop_strings):
            req.finished = "stop"
            cut = min(req.text.find(s) for s in req.stop_strings if s in req.text)
            piece = piece[:max(0, len(piece) - (len(req.text) - cut))]
            req.text = req.text[:cut]
            req.text_cut = True
        elif len(req.output) >= req.max_tokens:
            req.finished = "length"
        if req.finished in ("stop", "length") and dec is not None and not req.text_cut:
            rest = dec.flush()
            piece += rest
            req.text += rest
        if req.finished:
            self.running.remove(req)
            self.kv.free_sequence(req.id)
            self.decoders.pop(req.id, None)
        else:
            self.kv.append_tokens(req.id, [token])
        return Event(req.id, token, piece, req.finished)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (max(n, 1) - 1).bit_length()


def _bucket(n: int, cap: int) -> int:
    """Batch rows padded to a power of two, so a handful of captured steps serve every batch size."""
    return min(_pow2(n), max(cap, n))
