"""n-gram prompt lookup (no model): a baseline, and fast on copy-heavy prompts (Saxena, "Prompt Lookup
Decoding", 2023). The last n tokens of the request (prompt + output, pending token included) are looked up
in its earlier tokens, longest n first; the tokens that followed the most recent match are the drafts, with
a one-hot q (verification stays lossless at any temperature; under the Gumbel-max scheme a draft is accepted iff
it equals the target's own Gumbel-max token at its position)."""

from __future__ import annotations

import numpy as np

from sparkspec.spec_decode.proposer import HostProposer


def lookup(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    arr = np.asarray(ids, dtype=np.int64)
    L = arr.size
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = arr[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            j = int(hits[-1])
            return arr[j + n : j + n + k].tolist()
    return []


class NgramProposer(HostProposer):
    method = "ngram"

    def __init__(self, num_spec_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(num_spec_tokens)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes: expected 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose_ids(self, token_ids: list[list[int]], k: int) -> list[list[int]]:
        return [lookup(ids, k, self.max_ngram, self.min_ngram) for ids in token_ids]
