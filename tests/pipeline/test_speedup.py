"""The speculative-sampling speed-up table (Leviathan et al.'s formulas), reproduced exactly from the formulas (c = c_hat = 0)."""

import pytest

from multitoken.pipeline.eval.speedup import (
    acceptance_from_tokens, expected_tokens, operations_factor, speedup_row, walltime_improvement,
)

# (a, g) -> (operations, speed) as printed in the speculative-decoding notes, Table 1.
SEED_TABLE = {
    (0.6, 2): (1.53, 1.96), (0.7, 3): (1.58, 2.53), (0.8, 2): (1.23, 2.44),
    (0.8, 5): (1.63, 3.69), (0.9, 2): (1.11, 2.71), (0.9, 10): (1.60, 6.86),
}


def test_reproduces_seed_table():
    for (a, g), (ops, speed) in SEED_TABLE.items():
        row = speedup_row(a, g)
        assert round(row.speed, 2) == speed
        assert round(row.operations, 2) == ops


def test_hand_values_and_limits():
    # a = 0.5, g = 2: 1 + 0.5 + 0.25 tokens; with c = 0.1 the wall time divides by 1.2.
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert walltime_improvement(0.5, 2, c=0.1) == pytest.approx(1.75 / 1.2)
    assert operations_factor(0.5, 2, c_hat=0.5) == pytest.approx(4.0 / 1.75)
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert acceptance_from_tokens(1.75, 2) == pytest.approx(0.5, abs=1e-8)
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError):
        acceptance_from_tokens(4.0, 2)


def test_theory_from_measured_tokens():
    from multitoken.pipeline.eval.speedup import theory_from_tokens

    row = theory_from_tokens(1.75, 2, c=0.1)  # a = 0.5 gives 1.75 tokens per step
    assert row["a"] == pytest.approx(0.5, abs=1e-8)
    assert row["speed"] == pytest.approx(1.75 / 1.2)
    assert row["operations"] == pytest.approx((2 * 0.1 + 2 + 1) / 1.75)  # c_hat = c
    assert theory_from_tokens(0.5, 2)["a"] == pytest.approx(0.0, abs=1e-8)  # clamped to one token
