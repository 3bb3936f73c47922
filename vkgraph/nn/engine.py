"""The generation engine: continuous batching over a paged KV cache with prefix caching, GPU sampling,
stop conditions and streaming.

Each `step()` admits waiting requests while KV blocks last (their prompts are computed together in one pass,
minus any prefix already cached, and their first tokens sampled), then runs one decode step for every running
request, as one replay of a captured step (vkgraph.jit) per batch-size bucket. Requests join and leave between
steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..flags import flag
from ..jit import jit
from ..templates.common import pow2_ceil
from ..tensor import Tensor, manual_seed
from .kv_cache import KVCacheManager, OutOfKVBlocks
from .kv_tiers import BlockCopier, PrefixStore
from .layers import StepInputs
from .llama import LlamaModel
from .sampling import SamplingParams, SamplingTensors, sample, token_logprobs
from .tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from ..runtime import HostCopy


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    output: list[int] = field(default_factory=list)
    text: str = ""
    finished: str | None = None  # "stop", "length", "abort" or "error" once done
    cached_prompt_tokens: int = 0
    text_cut: bool = False  # a stop string ended the text
    sent: int = 0  # characters of text streamed out so far
    preemptions: int = 0  # times its KV blocks were taken back and its tokens recomputed later
    error: str | None = None  # why it finished with "error"
    logprobs: int | None = None  # report each token's log-probability and this many most likely alternatives

    def tokens(self) -> list[int]:
        """What its KV cache holds once computed: the prompt and every generated token."""
        return self.prompt + self.output


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its raw logits) and the most likely
    tokens at that position as (id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class Event:
    """One streamed piece of output. `token` is None only in the event of a request finished by an error.
    `logprobs` is set for a token of a request that asked for them."""

    request_id: int
    token: int | None
    text: str
    finished: str | None
    logprobs: TokenLogprob | None = None


_STEP_CONSTANTS = 16  # sampling-parameter and placeholder tensors an engine keeps
_PLACEHOLDER = -1  # the token of a KV slot reserved for a token still on the device (decode ahead)
# top-k widths a step computes (the smallest that covers every request's), so a handful of captures serve all
_TOP_BUCKETS = (1, 5, 20)
MAX_TOP_LOGPROBS = _TOP_BUCKETS[-1]
MAX_PREFILL_TOKENS = 4096  # prompt tokens an engine computes in one admission pass, by default


@dataclass
class _Mark:
    """A request's state between steps, to roll a failed step back to."""

    req: Request
    n_output: int
    text: str
    finished: str | None
    text_cut: bool
    sent: int
    preemptions: int
    decoder: tuple[IncrementalDecoder, tuple[int, int, int]] | None


@dataclass
class _InFlight:
    """A decode step submitted but not yet read: its batch (row i is reqs[i]), its sampled tokens on the device
    (the next step's input ids while the batch stays) and their copy on its way to the host."""

    reqs: list[Request]
    tokens: Tensor
    host: HostCopy


@dataclass
class _Before:
    """The queues, counters and pending error events before a step."""

    running: list[Request]
    waiting: list[Request]
    stats: dict[str, int]
    failed: list[Event]


class Engine:
    """Serve many requests on one model. `generate()` streams; `step()` advances every request by a token.
    The model is a LlamaModel or one called the same way (vkgraph.parallel.TensorParallelModel).

    Scheduling, each step: every running request first gets a KV slot for the token it sampled last; when blocks
    run out the newest running request is preempted (its blocks freed, it goes back to the front of the queue
    and is recomputed from its prompt and generated tokens when admitted again, as vLLM's recompute mode does;
    greedy output is unchanged). Waiting requests are admitted only in steps without preemption, while blocks
    last. A request whose prompt and max_tokens exceed the model's context (never more than the whole pool) is
    refused by `add_request`.

    `step()` is transactional: if anything raises inside it (a device error, a KeyboardInterrupt), every request
    is put back to its state before the step (KV blocks returned; running ones are requeued and recomputed),
    except that on an `Exception` the requests that took part in the step finish with "error" (reported by an
    event at the next step) so a failure that repeats cannot loop forever. Then the exception propagates.

    Decode ahead (VKGRAPH_DECODE_AHEAD): a decode step is left in flight when `step()` returns, and the next
    `step()` submits the following one, fed with the tokens still on the device, before it reads them back. The GPU
    then runs step after step while the host reads tokens, checks stops and prepares inputs, instead of idling
    through that host time every step. The slot of each token in flight is reserved with a placeholder that the
    token replaces once read. A request that stops on a token read this way had one more step computed for it,
    which is dropped. Steps go one at a time where the batch changes (a request waits for a free row, one finished
    or was aborted), where a request needs its tokens on the host before the next step (logprobs, repetition
    penalty, a seed, a prefix store below the GPU's blocks) and where one reaches max_tokens with the token in
    flight."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None = None, *, max_batch: int = 32,
                 prefix_caching: bool = True, seed: int = 0, max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                 prefix_store: PrefixStore | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens computed in one admission pass
        # prefix_store: tiers below the GPU prefix cache (host memory, disk) that evicted blocks go to
        self.kv = KVCacheManager(model.caches[0].num_blocks, model.block_size, prefix_caching=prefix_caching,
                                 store=prefix_store)
        if prefix_store is not None and not isinstance(model, LlamaModel):  # its caches hold one rank's heads
            raise ValueError("a prefix store needs the model on one device (a LlamaModel)")
        self._blocks = BlockCopier(model.caches) if prefix_store is not None else None
        self.vocab = model.config.vocab_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.ids = itertools.count()
        self.decoders: dict[int, IncrementalDecoder] = {}
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "decode_tokens": 0, "decode_steps": 0,
                      "preemptions": 0, "recomputed_tokens": 0, "failed_steps": 0, "decode_ahead_steps": 0}
        self._failed: list[Event] = []  # error events of requests a failed step finished, for the next step
        self._marks: list[_Mark] = []  # the state before this step of each request it has touched
        manual_seed(seed)
        self._host_rng = np.random.default_rng(seed)  # rows batched with a seeded request (see _noise)
        # a batch's sampling parameters and zero placeholders, uploaded once while the batch keeps them rather than
        # every step: a small batch's decode step waits on the host's work between replays
        self._step_constants: dict[tuple, SamplingTensors | Tensor] = {}
        # a model whose step cannot be one captured graph (vkgraph.parallel's: host all-reduces inside) runs eagerly
        capturable = getattr(model, "capturable", True)
        self._decode = jit(self._decode_step, max_entries=16) if capturable else self._decode_step
        self._ahead = capturable and bool(flag("VKGRAPH_DECODE_AHEAD"))
        self._in_flight: _InFlight | None = None  # the decode step submitted and not yet read (decode ahead)
        # prefills of up to VKGRAPH_PREFILL_CAPTURE_ROWS rows: a capture keeps its intermediates (for a Q4_0 8B-shape
        # pass at 512 rows, the activations of a layer; without cooperative matrices also the float16 weight
        # temporaries), so few are kept, and larger prefills, whose GPU time dwarfs the host's, run eagerly
        self._prefill_pass = jit(self._forward, max_entries=4) if capturable else self._forward

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, max_tokens: int = 64,
                    stop: Sequence[str] = (), stop_token_ids: Sequence[int] | None = None,
                    logprobs: int | None = None) -> int:
        """Queue a request. With `logprobs` (0 to MAX_TOP_LOGPROBS) each of its events carries the token's
        log-probability and that many most likely alternatives."""
        ids = self._encode(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        # the model's context never exceeds its KV pool, so a request that fits it can always run alone
        if len(ids) + max_tokens > self.model.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                             f"of {self.model.max_context} tokens (its KV cache holds {self.kv.num_blocks} blocks of "
                             f"{self.kv.block_size})")
        if max(ids) >= self.vocab or min(ids) < 0:
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        eos = set(stop_token_ids if stop_token_ids is not None else
                  (self.tokenizer.eos_ids if self.tokenizer is not None else ()))
        req = Request(next(self.ids), ids, params or SamplingParams(), max_tokens, frozenset(eos), tuple(stop),
                      logprobs=logprobs)
        self.waiting.append(req)
        if self._blocks is not None:
            self.kv.prefetch(ids)  # a queued request's prefix on disk is read while it waits
        return req.id

    def abort(self, request_id: int) -> None:
        for group in (self.waiting, self.running):
            for r in list(group):
                if r.id == request_id:
                    group.remove(r)
                    r.finished = "abort"
                    if r.id in self.kv.seqs:
                        self.kv.free_sequence(r.id)
        self.decoders.pop(request_id, None)
        self._failed = [e for e in self._failed if e.request_id != request_id]
        if self._in_flight is not None and not any(r in self.running for r in self._in_flight.reqs):
            self._in_flight = None  # a step for nobody: nothing to read (its memory returns once it completes)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._failed or self._in_flight)

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                 **kwargs: object) -> Iterator[Event]:
        """Add the prompts and stream events until all are finished."""
        for p in prompts:
            self.add_request(p, params, **kwargs)
        while self.has_work():
            yield from self.step()

    # ---- one step -----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        before = _Before(list(self.running), list(self.waiting), dict(self.stats), list(self._failed))
        self._marks = []
        try:  # everything up to handing the events back: an interrupt anywhere in it rolls the step back
            self._marks = [self._mark(r) for r in self.running]  # and each request the step takes from the queue
            events = self._failed
            flight, self._in_flight = self._in_flight, None
            if flight is not None:  # submit the next step before reading this one, where the batch lets it
                ahead = self._decode_ahead(flight)
                events = events + self._land(flight.reqs, flight.host.result(), None, ahead=ahead)
                if ahead:
                    self._failed = []
                    return events
            if not self._reserve_running():  # no preemption: there is room to admit
                events = events + self._admit()
                self._reserve_running()  # the first tokens of those admitted (room was reserved for them)
            if self.running:
                events = events + self._decode_running()
            self._failed = []
            return events
        except BaseException as e:
            self._roll_back(before, e)
            raise

    def _reserve_running(self) -> bool:
        """Give every running request a KV slot for its last sampled token, oldest first, preempting the newest
        running request while blocks are short. Returns whether it preempted any."""
        preempted = False
        for r in list(self.running):
            while r in self.running and self.kv.context_len(r.id) < len(r.prompt) + len(r.output):
                try:
                    self.kv.append_tokens(r.id, r.output[-1:])
                except OutOfKVBlocks:
                    self._preempt(self.running[-1])
                    preempted = True
        return preempted

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_sequence(req.id)
        self.waiting.insert(0, req)  # preempted newest first, so the oldest ends at the front
        req.preemptions += 1
        self.stats["preemptions"] += 1

    def _admit(self) -> list[Event]:
        """Admit waiting requests while KV blocks and batch rows last, and prefill them in one forward pass.
        A request returning from preemption is prefilled with its generated tokens and continues."""
        admitted: list[tuple[Request, int]] = []
        pending_tokens = 0
        first_token_blocks = 0  # blocks the admitted requests' first sampled tokens will need
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            tokens = req.tokens()
            if admitted and pending_tokens + len(tokens) > self.max_prefill_tokens:
                break
            grows = len(tokens) % self.kv.block_size == 0 and len(req.output) + 1 < req.max_tokens
            try:
                cached = self.kv.add_sequence(req.id, tokens, reserve=first_token_blocks + grows)
            except OutOfKVBlocks:
                if not self.running and not admitted:  # blocks held outside this engine; never free here
                    self._marks.append(self._mark(req))
                    self.waiting.pop(0)
                    self._fail(req, f"needs more KV blocks than are free ({self.kv.num_free_blocks})")
                    continue
                break  # wait for running requests to finish
            self._marks.append(self._mark(req))
            self.waiting.pop(0)
            first_token_blocks += grows
            if req.output:
                self.stats["recomputed_tokens"] += len(tokens) - cached
            else:
                req.cached_prompt_tokens = cached
                self.stats["prompt_tokens"] += len(tokens)
                self.stats["cached_prompt_tokens"] += cached
            pending_tokens += len(tokens) - cached
            admitted.append((req, cached))
        if not admitted:
            return []
        reqs = [r for r, _ in admitted]
        self._move_blocks()
        logits = self._prefill(reqs, continue_cached=any(c for _, c in admitted))
        tokens, lps = self._sample(logits, reqs)
        for r in reqs:  # after the pass ran: only KV actually written may enter the prefix cache
            self.kv.mark_computed(r.id)
        events = []
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            self.running.append(r)
            events.append(self._emit(r, int(t), _row_logprob(lps, i, r)))
        return events

    def _prefill(self, reqs: list[Request], continue_cached: bool) -> Tensor:
        """Logits (len(reqs), vocab) of each prompt's last token, computing only tokens not already cached.

        Token rows are padded to a power of two (at least 16): prompts of similar length then share one set of
        compiled kernels and one cached schedule, and up to VKGRAPH_PREFILL_CAPTURE_ROWS rows, one captured pass (the
        forward pass is a vkgraph.jit function of its inputs, as the decode step is: replayed from the third
        prefill of a shape on, with no graph built, scheduled or recorded on the host). Padding rows write no KV
        (slot -1) and are never read."""
        ids = [r.id for r in reqs]
        real = sum(self.kv.context_len(i) - self.kv.num_computed(i) for i in ids)
        rows = pow2_ceil(max(real, 16))
        meta = self.kv.batch(ids, width=self.model.max_blocks_per_seq, pad_tokens=rows)
        qsl = meta.query_start_loc
        if not continue_cached:
            cu_seqlens, tables, context_lens, prefix_lens, seq_tables = Tensor(qsl), None, None, None, None
        else:  # some continue a cached prefix: each new token is a query row over the paged cache (paged_decode),
            # or where flash prefill runs, each sequence one prefill over its cached prefix and new tokens; the
            # model picks, so both forms go in
            table = np.zeros((rows, meta.block_tables.shape[1]), np.int32)
            table[:real] = np.repeat(meta.block_tables, np.diff(qsl), axis=0)
            cu_seqlens, tables, context_lens = Tensor(qsl), Tensor(table), Tensor(meta.positions + 1)
            prefix_lens = Tensor((meta.context_lens - np.diff(qsl)).astype(np.int32))
            seq_tables = Tensor(meta.block_tables)
        forward = self._prefill_pass if rows <= flag("VKGRAPH_PREFILL_CAPTURE_ROWS") else self._forward
        return forward(Tensor(meta.input_ids), Tensor(meta.positions), Tensor(meta.slot_mapping), cu_seqlens, tables,
                       context_lens, prefix_lens, seq_tables, Tensor((qsl[1:] - 1).astype(np.int32)), rows)

    def _forward(self, ids: Tensor, positions: Tensor, slots: Tensor, cu_seqlens: Tensor,
                 tables: Tensor | None, context_lens: Tensor | None, prefix_lens: Tensor | None,
                 seq_tables: Tensor | None, logit_rows: Tensor, max_seq_len: int) -> Tensor:
        """The prefill's forward pass: logits at `logit_rows`. Over `cu_seqlens` its attention's grid covers
        `max_seq_len` query rows per prompt (the padded rows, so that one capture serves every prompt of the
        bucket; rows past a prompt's end do nothing). Prompts that continue cached prefixes also pass the paged
        cache's view per query row (`tables`, `context_lens`) and per sequence (`prefix_lens`, `seq_tables`)."""
        step = StepInputs(positions, slots, block_tables=tables, context_lens=context_lens, cu_seqlens=cu_seqlens,
                          max_seq_len=max_seq_len, prefix_lens=prefix_lens, seq_block_tables=seq_tables)
        if isinstance(self.model, LlamaModel):  # each layer submitted as it is built (see LlamaModel.__call__)
            return self.model(ids, step, logit_rows=logit_rows, stream_layers=True)
        return self.model(ids, step, logit_rows=logit_rows)

    def _move_blocks(self) -> None:
        """Before a pass: copy the hashed blocks just evicted from the GPU into the prefix store (the pass may
        overwrite them), then write the blocks found in the store into the GPU blocks allocated for them."""
        if self._blocks is None:
            return
        store = self.kv.store
        evicted = [(b, h) for b, h in self.kv.take_evicted() if h not in store]
        if evicted:
            store.put_many([(h, p) for (_, h), p in zip(evicted, self._blocks.read([b for b, _ in evicted]))])
        restores = self.kv.take_restores()
        if restores:
            self._blocks.write([r.block for r in restores], [r.payload for r in restores])
            self.kv.commit_restores(restores)

    def offload_prefix_cache(self) -> None:
        """Move every cached prefix block that no request holds from the GPU into the prefix store (between
        steps): e.g. before the GPU's blocks are needed for something else, or to time the store's tiers."""
        if self._blocks is not None:
            self.kv.evict_cached()
            self._move_blocks()

    def _decode_running(self, ids: Tensor | None = None) -> list[Event]:
        """One decode step of every running request, fed `ids` (the tokens of the step in flight, still on the
        device) or the last sampled tokens. Read back now, or left in flight for the next step() where the batch
        can run ahead (`_can_run_ahead`)."""
        reqs = list(self.running)
        self._move_blocks()
        rows = _bucket(len(reqs), self.max_batch)
        meta = self.kv.batch([r.id for r in reqs], width=self.model.max_blocks_per_seq, pad_seqs=rows,
                             pad_tokens=rows)
        st = self._sampling(reqs, rows)
        presence = self._presence(reqs, rows)
        noise = self._noise(st, reqs, rows)
        width = self._top_width(reqs)
        out = self._decode(Tensor(meta.input_ids) if ids is None else ids, Tensor(meta.positions),
                           Tensor(meta.slot_mapping), Tensor(meta.block_tables), Tensor(meta.context_lens),
                           st.temperature, st.top_k, st.top_p, st.min_p, st.penalty, presence, noise, st.use_top_k,
                           st.use_top_p, st.use_sampling, width)
        self.stats["decode_steps"] += 1
        if self._can_run_ahead(reqs, width):
            self._in_flight = _InFlight(reqs, out, out.copy_to_host_async())
            return []
        tokens, lps = _host(out)
        return self._land(reqs, tokens, lps, ahead=False)

    def _can_run_ahead(self, reqs: list[Request], width: int) -> bool:
        """Whether the step after this one may be fed this one's tokens on the device: nothing about the batch
        needs them on the host first (see the class doc)."""
        return (self._ahead and width == 0 and self._blocks is None
                and all(r.params.repetition_penalty == 1.0 and r.params.seed is None for r in reqs))

    def _decode_ahead(self, flight: _InFlight) -> bool:
        """Submit the step after `flight`, fed its tokens on the device, if the batch is unchanged, no request
        waits for a free row to join and none ends by length with the token in flight; each running request first
        gets a slot for that token, holding a placeholder until it is read. Whether it was submitted."""
        if ((self.waiting and len(self.running) < self.max_batch) or flight.reqs != self.running
                or any(len(r.output) + 1 >= r.max_tokens for r in self.running)):
            return False
        grown = []
        try:
            for r in self.running:
                self.kv.mark_computed(r.id)  # the step in flight computes them, on the queue before the next
                self.kv.append_tokens(r.id, [_PLACEHOLDER])
                grown.append(r)
        except OutOfKVBlocks:  # the step waits for the tokens, and preemption makes room
            for r in grown:
                self.kv.truncate(r.id, self.kv.context_len(r.id) - 1)
            return False
        self._decode_running(ids=flight.tokens)
        self.stats["decode_ahead_steps"] += 1
        return True

    def _land(self, reqs: list[Request], tokens: np.ndarray, lps: tuple[np.ndarray, ...] | None, *,
              ahead: bool) -> list[Event]:
        """Emit a decode step's tokens, row i to reqs[i], skipping rows of requests no longer running (finished or
        aborted while the step was in flight). With `ahead` the next step is in flight already: each token
        replaces its placeholder, whose KV that step is computing (and marks computed when it lands)."""
        events = []
        for i, r in enumerate(reqs):
            if r not in self.running:
                continue
            if ahead:
                self.kv.set_token(r.id, self.kv.context_len(r.id) - 1, int(tokens[i]))
            else:
                self.kv.mark_computed(r.id)
            events.append(self._emit(r, int(tokens[i]), _row_logprob(lps, i, r)))
        return events

    def _decode_step(self, ids, positions, slots, tables, ctx, temperature, top_k, top_p, min_p, penalty, presence,
                     noise, use_top_k, use_top_p, use_sampling, top_width):
        step = StepInputs(positions=positions, slot_mapping=slots, block_tables=tables, context_lens=ctx, decode=True)
        logits = self.model(ids, step)
        st = SamplingTensors(temperature, top_k, top_p, min_p, penalty, use_top_k, use_top_p, use_sampling)
        return _with_logprobs(logits, sample(logits, st, presence, noise), top_width)

    def _sample(self, logits: Tensor, reqs: list[Request]) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
        st = self._sampling(reqs, len(reqs))
        tokens = sample(logits, st, self._presence(reqs, len(reqs)), self._noise(st, reqs, len(reqs)))
        return _host(_with_logprobs(logits, tokens, self._top_width(reqs)))

    def _top_width(self, reqs: list[Request]) -> int:
        """How many most likely tokens a step computes: 0 when no request asks for logprobs (none computed)."""
        want = [r.logprobs for r in reqs if r.logprobs is not None]
        if not want:
            return 0
        return min(next(b for b in _TOP_BUCKETS if b >= max(want)), self.vocab)

    def _sampling(self, reqs: list[Request], rows: int) -> SamplingTensors:
        """The rows' sampling parameters as tensors, the same ones while the batch's parameters are unchanged."""
        params = [r.params for r in reqs]
        key = ("sampling", rows, tuple((p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)
                                       for p in params))
        return self._step_constant(key, lambda: SamplingTensors.build(params, rows, self.vocab))

    def _zero_column(self, rows: int) -> Tensor:
        """A (rows, 1) float32 zero column, the placeholder of an unused noise or presence input."""
        return self._step_constant(("zeros", rows), lambda: Tensor(np.zeros((rows, 1), np.float32)))

    def _step_constant(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The step input kept under `key`, made (and kept) on first use; batches come and go, so the whole set
        starts afresh once it holds _STEP_CONSTANTS."""
        value = self._step_constants.get(key)
        if value is None:
            if len(self._step_constants) >= _STEP_CONSTANTS:
                self._step_constants.clear()
            value = self._step_constants[key] = make()
        return value

    def _noise(self, st: SamplingTensors, reqs: list[Request], rows: int) -> Tensor:
        """Uniform noise for the Gumbel draw; a (rows, 1) placeholder when every row is greedy (no vocabulary-
        sized random kernel per step). A request with a seed draws from a generator keyed by (seed, the index of
        the token drawn), so its output does not depend on the batch it runs in or on preemption; a batch holding
        one is drawn on the host (the other rows from the engine's own seeded generator)."""
        if not st.use_sampling:
            return self._zero_column(rows)
        if all(r.params.seed is None for r in reqs):
            return Tensor.rand(rows, self.vocab)
        noise = self._host_rng.random((rows, self.vocab), dtype=np.float32)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                noise[i] = np.random.default_rng([r.params.seed, len(r.output)]).random(self.vocab, np.float32)
        return Tensor(noise)

    def _presence(self, reqs: list[Request], rows: int) -> Tensor:
        """Tokens each request has seen, for the repetition penalty; a (rows, 1) zero column (broadcast, and no
        vocabulary-sized upload every step) when no request uses the penalty."""
        if all(r.params.repetition_penalty == 1.0 for r in reqs):
            return self._zero_column(rows)
        mask = np.zeros((rows, self.vocab), np.float32)
        for i, r in enumerate(reqs):
            if r.params.repetition_penalty != 1.0:
                mask[i, r.prompt] = 1.0
                mask[i, r.output] = 1.0
        return Tensor(mask)

    # ---- output and stopping ------------------------------------------------------------------------------
    def _emit(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> Event:
        """Record a sampled token. Its KV slot is reserved at the start of the next step (`_reserve_running`)."""
        req.output.append(token)
        self.stats["decode_tokens"] += 1
        dec = None
        if self.tokenizer is not None:
            dec = self.decoders.get(req.id)
            if dec is None:
                dec = self.decoders[req.id] = self.tokenizer.stream()
            req.text += dec.push(token)
        if token in req.stop_ids:
            req.finished = "stop"
        elif any(s in req.text for s in req.stop_strings):
            req.finished = "stop"
            req.text = req.text[:min(req.text.find(s) for s in req.stop_strings if s in req.text)]
            req.text_cut = True
        elif len(req.output) >= req.max_tokens:
            req.finished = "length"
        if req.finished in ("stop", "length") and dec is not None and not req.text_cut:
            req.text += dec.flush()
        # text that may begin a stop string is held back until the next tokens show whether it does
        end = len(req.text) if req.finished else len(req.text) - _stop_prefix(req.text, req.stop_strings)
        piece = req.text[req.sent:end]
        req.sent = max(req.sent, end)
        if req.finished:
            self.running.remove(req)
            self.kv.free_sequence(req.id)
            self.decoders.pop(req.id, None)
        return Event(req.id, token, piece, req.finished, logprob)

    def _fail(self, req: Request, why: str) -> None:
        """Finish a request that is in no queue with an error, reported by an event at the next step."""
        req.finished, req.error = "error", why
        if req.id in self.kv.seqs:
            self.kv.free_sequence(req.id)
        self.decoders.pop(req.id, None)
        self._failed.append(Event(req.id, None, "", "error"))

    # ---- rolling a failed step back -----------------------------------------------------------------------------
    def _mark(self, req: Request) -> _Mark:
        dec = self.decoders.get(req.id)
        return _Mark(req, len(req.output), req.text, req.finished, req.text_cut, req.sent, req.preemptions,
                     None if dec is None else (dec, dec.mark()))

    def _roll_back(self, before: _Before, exc: BaseException) -> None:
        """Put every request back to its state before the step, as waiting (its KV recomputed on admission); on an
        Exception, finish those the step touched with an error instead."""
        for m in self._marks:
            r = m.req
            del r.output[m.n_output:]
            r.text, r.finished, r.text_cut, r.sent = m.text, m.finished, m.text_cut, m.sent
            r.preemptions = m.preemptions
            if m.decoder is None:
                self.decoders.pop(r.id, None)
            else:  # a request that finished in the step had its decoder dropped: bring it back
                dec, point = m.decoder
                dec.rewind(point)
                self.decoders[r.id] = dec
        self._in_flight = None  # its requests are recomputed: the tokens it holds were never emitted
        self.stats.update(before.stats)
        self.stats["failed_steps"] += 1
        self._failed = before.failed
        queue = before.running + before.waiting
        try:
            for r in queue:
                if r.id in self.kv.seqs:
                    self.kv.free_sequence(r.id)
            self.kv.check_invariants()
        except Exception:  # interrupted inside the cache manager: start its books afresh
            self.kv.reset()
        self.kv.take_evicted()  # a cache: blocks not yet copied out are simply lost
        self.kv.take_restores()
        touched = {id(m.req) for m in self._marks}
        self._marks = []
        why = f"{type(exc).__name__}: {exc}"
        self.running, self.waiting = [], []
        for r in queue:
            if isinstance(exc, Exception) and id(r) in touched:
                self._fail(r, why)
            else:
                self.waiting.append(r)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]


def _with_logprobs(logits: Tensor, tokens: Tensor, width: int) -> Tensor | tuple[Tensor, ...]:
    """A step's output: its sampled tokens, and with them their log-probabilities and the `width` most likely
    tokens' when some request asks for logprobs (width > 0; `_host` takes either apart)."""
    return tokens if width == 0 else (tokens, *token_logprobs(logits, tokens, width))


def _host(out: Tensor | tuple[Tensor, ...]) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
    """A step's sampled tokens, and its (chosen, top ids, top log-probabilities) when it computed them."""
    if isinstance(out, Tensor):
        return out.numpy(), None
    tokens, *lps = (t.numpy() for t in out)
    return tokens, tuple(lps)


def _row_logprob(lps: tuple[np.ndarray, ...] | None, row: int, req: Request) -> TokenLogprob | None:
    if lps is None or req.logprobs is None:
        return None
    chosen, ids, vals = lps
    top = tuple((int(i), float(v)) for i, v in zip(ids[row, :req.logprobs], vals[row, :req.logprobs]))
    return TokenLogprob(float(chosen[row]), top)


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string (without being all of it)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def _bucket(n: int, cap: int) -> int:
    """Batch rows padded to a power of two, so a handful of captured steps serve every batch size."""
    return min(pow2_ceil(n), max(cap, n))
