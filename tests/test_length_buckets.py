"""How a padded batch is split into sub-batches of similar length (backends.base.length_buckets)."""

from __future__ import annotations

import itertools

import pytest

from macaron_local.learn.backends.base import length_buckets, make_batch, real_lengths


def cost(lengths, buckets, overhead):
    return sum(overhead + len(b) * max(lengths[i] for i in b) for b in buckets)


def brute_force(lengths, overhead):
    """The cheapest split over every partition into contiguous runs of the sorted rows."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    best = None
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        buckets, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts, strict=True):
            if cut:
                buckets.append(current)
                current = []
            current.append(row)
        buckets.append(current)
        value = cost(lengths, buckets, overhead)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize(
    "lengths",
    [[150] * 6, [150, 140, 150, 60, 62, 145], [10, 200], [5], [100, 99, 98, 20, 19, 18, 300, 7]],
)
@pytest.mark.parametrize("overhead", [0, 48, 1000])
def test_buckets_cover_every_row_once_at_the_least_cost(lengths, overhead):
    buckets = length_buckets(lengths, overhead)
    assert sorted(itertools.chain.from_iterable(buckets)) == list(range(len(lengths)))
    assert cost(lengths, buckets, overhead) == brute_force(lengths, overhead)


def test_equal_rows_stay_one_batch_and_a_huge_overhead_never_splits():
    assert length_buckets([150] * 6) == [list(range(6))]
    assert length_buckets([300, 10, 10, 10], overhead=10_000) == [[0, 1, 2, 3]]


def test_short_passages_leave_the_long_samples_batch():
    lengths = [150, 148, 151, 149, 147, 150, 60, 58]
    assert sorted(map(sorted, length_buckets(lengths))) == [[0, 1, 2, 3, 4, 5], [6, 7]]


def test_real_lengths_end_at_the_last_scored_token():
    batch = make_batch([[1, 2, 3], [4], [5, 6]], [[7], [8, 9, 10, 11], []])
    assert real_lengths(batch) == [3, 4, len(batch.mask[2])]  # nothing scored: the full width
