"""Weighted blends of several sources, as a pure function of (seed, global sample index, weights).

Why not sample a source per index at random: shares would only converge on average, and a
resumed or re-planned job must re-derive exactly which source and which window every global
index read, with no state but `samples_consumed`.

Assignment: global indices are cut into blocks of B samples. The first b blocks hold
`cumulative(b)[j]` samples of source j: the largest-remainder rounding of share_j * B * b, in
exact rational arithmetic. So every block carries the rounding error of the blocks before it and
the count over any run of whole blocks is within one of its share. Inside block b the B slots
are dealt in order (source 0's count first) and then shuffled by the seeded permutation of
(seed, b), so sources interleave. B is at least 1 / the smallest share, which keeps every
block count non-negative (a share below 1e-6 is refused, so B is at most 10^6); with the
default B = 64 and shares >= 1/64, any 10,000 consecutive samples hold each source within 1
percentage point of its share (whole blocks are exact to one sample, the two partial blocks at
the ends hold at most 80 samples together).

Per-source index: the index of a sample among its source's samples is
`cumulative(b)[j] + (slot - first slot of j in block b)`, O(1) per sample. It goes through the
source's own seeded permutation with epochs, exactly as a single source's order does; a source
that runs out starts its next epoch (logged once per process and source).
"""
from __future__ import annotations

import logging
import math
from fractions import Fraction

import numpy as np

from tenax.workers.data.sources import TokenSource, permute

logger = logging.getLogger(__name__)

BLEND_BLOCK = 64
# A block holds at least 1 / (smallest share) samples; below this share blocks would outgrow
# int64 arithmetic (and a source would be drawn about never anyway).
MIN_SHARE = Fraction(1, 10**6)


def check_weights(weights: list[float]) -> list[Fraction]:
    """Weights as exact fractions; ValueError naming the index and value of a bad one, or of a
    weight whose share of the total is below MIN_SHARE."""
    if not weights:
        raise ValueError("data.sources: empty; give at least one {uri, weight}")
    out = []
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"data.sources[{i}].weight: must be a number > 0, got {weight!r}")
        out.append(Fraction(weight))
    total = sum(out)
    for i, weight in enumerate(out):
        if weight / total < MIN_SHARE:
            raise ValueError(f"data.sources[{i}].weight: share {plain(weight / total)} is "
                             f"below {plain(MIN_SHARE)}")
    return out


def plain(value: Fraction) -> str:
    """A share as people write it: 1e-20, 9.99999e-7, 0.25."""
    return f"{float(value):.6g}".replace("e-0", "e-")


def source_order(index: np.ndarray, n: int, seed: int | str) -> np.ndarray:
    """Sample ids of a source's own indices: its seeded permutation, one per epoch."""
    index = np.asarray(index, dtype=np.int64)
    epochs, offsets = index // n, index % n
    out = np.empty(index.shape[0], dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        sel = epochs == epoch
        out[sel] = permute(offsets[sel], n, seed, int(epoch))
    return out


class BlendAssignment:
    """Which source, and which of its indices, every global sample index reads."""

    def __init__(self, weights: list[float], seed: int, block: int = BLEND_BLOCK) -> None:
        fractions = check_weights(weights)
        total = sum(fractions)
        self.shares = [f / total for f in fractions]
        self.seed = seed
        self.block = max(block, math.ceil(1 / min(self.shares)))

    def cumulative(self, blocks: int) -> np.ndarray:
        """Samples of each source among the first `blocks` blocks (largest remainder)."""
        targets = [share * self.block * blocks for share in self.shares]
        counts = [t.numerator // t.denominator for t in targets]
        left = self.block * blocks - sum(counts)
        order = sorted(range(len(targets)), key=lambda j: (counts[j] - targets[j], j))
        for j in order[:left]:
            counts[j] += 1
        return np.array(counts, dtype=np.int64)

    def locate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of each global sample index."""
        index = np.asarray(index, dtype=np.int64)
        blocks, offsets = index // self.block, index % self.block
        source = np.empty(index.shape[0], dtype=np.int64)
        within = np.empty(index.shape[0], dtype=np.int64)
        for b in np.unique(blocks).tolist():
            sel = blocks == b
            before, after = self.cumulative(b), self.cumulative(b + 1)
            counts = after - before
            ends = np.cumsum(counts)
            slots = permute(offsets[sel], self.block, f"blend-{self.seed}", int(b))
            j = np.searchsorted(ends, slots, side="right")
            source[sel] = j
            within[sel] = before[j] + slots - (ends - counts)[j]
        return source, within


class BlendedSource:
    """Rows of global sample indices drawn from several sources by a `BlendAssignment`."""

    def __init__(self, sources: list[TokenSource], uris: list[str], weights: list[float],
                 seed: int) -> None:
        self.sources, self.uris, self.seed = sources, uris, seed
        self.assignment = BlendAssignment(weights, seed)
        self._epoch_logged: set[int] = set()
        # The blend never runs out: each source cycles through its epochs.
        self.num_samples = sum(s.num_samples for s in sources)

    def sample_ids(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample id within that source) of each global sample index."""
        source, within = self.assignment.locate(index)
        ids = np.empty_like(within)
        for j in np.unique(source).tolist():
            sel = source == j
            n = self.sources[j].num_samples
            ids[sel] = source_order(within[sel], n, f"{self.seed}-blend-{j}")
            if j not in self._epoch_logged and int(within[sel].max()) >= n:
                self._epoch_logged.add(j)
                logger.info("data.sources[%d] (%s): all %d samples used, starting its next "
                            "epoch", j, self.uris[j], n)
        return source, ids

    def rows(self, index: np.ndarray) -> np.ndarray:
        """int64 [len(index), seq_len + 1]: the windows global indices `index` read."""
        source, ids = self.sample_ids(index)
        parts = {j: self.sources[j].samples(ids[source == j]) for j in np.unique(source).tolist()}
        width = next(iter(parts.values())).shape[1] if parts else 0
        out = np.empty((index.shape[0], width), dtype=np.int64)
        for j, part in parts.items():
            out[source == j] = part
        return out
