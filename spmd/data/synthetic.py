"""The built-in data: a seeded random Markov chain.

Its entropy is known exactly, so a run can be judged against the best loss any model can
reach (the floor). Row `r` of the batch of step `k` is a pure function of (seed, k, r).
"""

from __future__ import annotations

import numpy as np

from spmd.data.source import DataSource

SUCCESSORS = 4  # each token can be followed by this many tokens


class MarkovSource(DataSource):
    """Sequences of a first-order Markov chain; the first token is uniform."""

    def __init__(self, vocab: int, seed: int, successors: int = SUCCESSORS):
        rng = np.random.default_rng([seed, 0x6D61726B])
        self.vocab = vocab
        self.seed = seed
        k = min(successors, vocab)
        # Row s of the transition matrix, stored sparsely: successors[s] with probs[s].
        self.successors = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(vocab)])
        self.probs = rng.dirichlet(np.ones(k), size=vocab)
        self._cdf = np.cumsum(self.probs, axis=1)
        self._cdf[:, -1] = 1.0
        self.rows_read = 0

    def entropy_floor(self, seq: int) -> float:
        """Mean cross-entropy (nats/token) of the true chain over `seq` predicted positions."""
        row_entropy = -np.sum(self.probs * np.log(np.maximum(self.probs, 1e-300)), axis=1)
        dist = np.full(self.vocab, 1.0 / self.vocab)
        total = 0.0
        for done in range(seq):
            total += float(dist @ row_entropy)
            nxt = np.zeros_like(dist)
            np.add.at(nxt, self.successors, dist[:, None] * self.probs)
            if np.abs(nxt - dist).sum() < 1e-13:  # stationary: every later position adds the same
                return (total + (seq - done - 1) * float(nxt @ row_entropy)) / seq
            dist = nxt
        return total / seq

    def describe(self, seq: int) -> str:
        return f"synthetic Markov chain (seed {self.seed}), floor {self.entropy_floor(seq):.4f} nats/token"

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of step `step`'s batch (or eval batch `step`'s), each `length` tokens, int32."""
        n = stop - start
        uniforms = np.empty((n, length))
        stream = () if split == "train" else (1,)  # held-out rows: another stream of draws
        for i, row in enumerate(range(start, stop)):
            uniforms[i] = np.random.default_rng([self.seed, step, row, *stream]).random(length)
        self.rows_read += n if split == "train" else 0
        tokens = np.empty((n, length), np.int32)
        tokens[:, 0] = np.minimum((uniforms[:, 0] * self.vocab).astype(np.int32), self.vocab - 1)
        for t in range(1, length):
            prev = tokens[:, t - 1]
            choice = (self._cdf[prev] < uniforms[:, t : t + 1]).sum(axis=1)
            tokens[:, t] = self.successors[prev, np.minimum(choice, self.successors.shape[1] - 1)]
        return tokens
