"""bench/row_length.py packs documents into rows as GPTDataset does: every token once, cut at row ends."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench_scripts import load_bench


@pytest.mark.parametrize("seq_length", [8192, 131072])
def test_rows_hold_every_token_once_and_no_piece_crosses_a_row_end(seq_length):
    rows, steps = 4, 2
    batches = load_bench("row_length").packed_steps(seq_length, rows, steps, seed=1)
    assert len(batches) == steps
    for batch in batches:
        lengths = batch.lengths
        assert lengths.sum() == rows * seq_length and lengths.max() <= seq_length
        # in order, the pieces close a row exactly every seq_length tokens
        ends = np.cumsum(lengths)
        assert set(range(seq_length, rows * seq_length + 1, seq_length)) <= set(ends.tolist())
    # long rows keep documents whole that 8K rows cut: their longest piece is above M
    if seq_length > 8192:
        assert max(int(b.lengths.max()) for b in batches) > 8192
