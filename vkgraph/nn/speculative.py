"""Speculative decoding: a small draft model proposes `k` tokens, the target model checks them in one pass.

Greedy requests produce exactly the target's greedy output (a draft token is kept only when it is the
target's argmax there). Sampled requests use the standard rejection rule: keep draft token x with probability
min(1, p(x) / q(x)) (p: target, q: draft distribution at that position); at the first rejection draw from
normalise(max(0, p - q)); when all k are kept, draw one more from the target. The output then has the target's
distribution. Both models keep their own paged KV caches; rejected tokens are truncated from both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..tensor import Tensor
from .kv_cache import KVCacheManager
from .layers import StepInputs
from .llama import LlamaModel
from .sampling import SamplingParams


@dataclass
class SpeculativeStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpeculativeDecoder:
    """Generate one sequence with `target`, drafting `k` tokens per round with `draft` (same vocabulary)."""

    def __init__(self, target: LlamaModel, draft: LlamaModel, k: int = 4, seed: int = 0) -> None:
        if target.config.vocab_size != draft.config.vocab_size:
            raise ValueError(f"draft vocabulary {draft.config.vocab_size} != target's {target.config.vocab_size}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.target, self.draft, self.k = target, draft, k
        self.kv = {m: KVCacheManager(m.caches[0].num_blocks, m.block_size, prefix_caching=False)
                   for m in (target, draft)}
        self.rng = np.random.default_rng(seed)
        self.stats = SpeculativeStats()

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams | None = None,
                 stop_token_ids: Sequence[int] = ()) -> Iterator[int]:
        params = params or SamplingParams()
        if len(prompt) + max_tokens + self.k + 1 > min(self.target.max_context, self.draft.max_context):
            raise ValueError("prompt + max_tokens + k exceeds a model's context")
        sid = object()
        for kv in self.kv.values():
            kv.add_sequence(sid, list(prompt))
        try:
            yield from self._rounds(sid, len(prompt), max_tokens, params, set(stop_token_ids))
        finally:
            for kv in self.kv.values():
                kv.free_sequence(sid)

    def _rounds(self, sid: object, n_prompt: int, max_tokens: int, params: SamplingParams,
                stops: set[int]) -> Iterator[int]:
        tkv, dkv = self.kv[self.target], self.kv[self.draft]
        # prefill both; the target's last row gives the first token
        self._logits(self.draft, sid, 0, n_prompt)
        first = self._choose(self._logits(self.target, sid, 0, n_prompt)[-1], params)
        done = 0
        token = first
        draft_valid = n_prompt  # tokens whose KV the draft has written
        while True:
            yield token
            done += 1
            if token in stops or done >= max_tokens:
                return
            n = tkv.context_len(sid)  # tokens whose KV is in both caches (the last emitted is not)
            for kv in (tkv, dkv):
                kv.mark_computed(sid, n)
                kv.append_tokens(sid, [token])
            # draft k tokens, one at a time (the first pass also fills the draft's KV of the previous round's
            # last draft token, which the draft never ran on when the target accepted every draft)
            drafts, q_rows = [], []
            for i in range(self.k):
                row = self._logits(self.draft, sid, min(draft_valid, n + i), n + i + 1)[-1]
                draft_valid = n + i + 1
                d = self._choose(row, params)
                q_rows.append(_probs(row, params))
                drafts.append(d)
                dkv.append_tokens(sid, [d])
            # the target scores the emitted token and every draft in one pass
            tkv.append_tokens(sid, drafts)
            p_rows = self._logits(self.target, sid, n, n + self.k + 1)
            accepted, token = self._verify(drafts, q_rows, p_rows, params)
            self.stats.rounds += 1
            self.stats.proposed += self.k
            self.stats.accepted += len(accepted)
            keep = n + 1 + len(accepted)
            draft_valid = min(keep, n + self.k)
            for kv in (tkv, dkv):
                kv.mark_computed(sid, min(keep, kv.context_len(sid)))
                kv.truncate(sid, keep)
            for t in accepted:
                yield t
                done += 1
                if t in stops or done >= max_tokens:
                    return
            # the next round starts from `token`; kv holds n + 1 + accepted tokens

    def _verify(self, drafts: list[int], q_rows: list[np.ndarray], p_rows: np.ndarray,
                params: SamplingParams) -> tuple[list[int], int]:
        accepted: list[int] = []
        for i, d in enumerate(drafts):
            if params.temperature == 0:
                best = int(np.argmax(p_rows[i]))
                if d != best:
                    return accepted, best
            else:
                p, q = _probs(p_rows[i], params), q_rows[i]
                if self.rng.random() >= min(1.0, p[d] / max(q[d], 1e-30)):
                    residual = np.maximum(p - q, 0.0)
                    residual = residual / residual.sum() if residual.sum() > 0 else p
                    return accepted, int(self.rng.choice(len(p), p=residual))
            accepted.append(d)
        return accepted, self._choose(p_rows[len(drafts)], params)

    def _choose(self, logits: np.ndarray, params: SamplingParams) -> int:
        if params.temperature == 0:
            return int(np.argmax(logits))
        p = _probs(logits, params)
        return int(self.rng.choice(len(p), p=p))

    def _logits(self, model: LlamaModel, sid: object, start: int, end: int) -> np.ndarray:
        """Logits (end - start, vocab) for tokens start..end-1; KV of tokens before `start` must be cached."""
        kv = self.kv[model]
        tokens = np.asarray(kv.seqs[sid].tokens[start:end], np.int32)
        pos = np.arange(start, end, dtype=np.int32)
        table = np.zeros((1, model.max_blocks_per_seq), np.int32)
        blocks = kv.block_table(sid)
        table[0, :len(blocks)] = blocks
        step = StepInputs(Tensor(pos), Tensor(kv.slot_mapping(sid, start, end)),
                          block_tables=Tensor(np.repeat(table, end - start, axis=0)), context_lens=Tensor(pos + 1))
        return model(Tensor(tokens), step).numpy()


def _probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (temperature only; filters would need the same on both sides)."""
    z = logits.astype(np.float64) / max(params.temperature, 1e-6)
    z = np.exp(z - z.max())
    return z / z.sum()
