"""bench/straggler_train.py's accounting of predictions (the training runs themselves are the bench's)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.bench_scripts import load_bench

straggler_train = load_bench("straggler_train")


def records(pairs):
    return SimpleNamespace(records=[SimpleNamespace(predicted_s=p, measured_s=m) for p, m in pairs])


def test_prediction_shares_count_steps_within_ten_percent_and_the_best_factor_in_hindsight():
    # measured / predicted 1.0, 1.05, 1.15, 1.2: two within 10 % as predicted; every prediction scaled by a
    # factor in [1.2 / 1.1, 1.1] holds all four: the noise floor is 100 % here
    run = records([(1.0, 1.0), (1.0, 1.05), (1.0, 1.15), (1.0, 1.2)])
    assert straggler_train.within(run, slice(None)) == 0.5
    assert straggler_train.best_constant(run, slice(None)) == 1.0
    spread = records([(1.0, 1.0), (1.0, 1.5), (1.0, 2.2)])  # no factor holds two of these within 10 %
    assert straggler_train.best_constant(spread, slice(None)) == 1 / 3
