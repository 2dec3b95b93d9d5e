"""The accuracy benchmark's metrics and tables (no model is installed or run here)."""
import math

import numpy as np
import pytest

from benchmarks import accuracy as acc


def test_sqnr_db():
    ref = np.array([3.0, 4.0])
    assert acc.sqnr_db(ref, ref) == math.inf
    assert acc.sqnr_db(ref, ref * 0.9) == pytest.approx(20.0)  # noise is 1% of the signal energy


def test_top1_agreement_and_label_accuracy():
    ref = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    out = np.array([[0.8, 0.2], [0.6, 0.4], [0.7, 0.3], [0.1, 0.9]])
    assert acc.top1_agreement(ref, out) == 75.0
    assert acc.label_accuracy(out, np.array([0, 1, 0, 0])) == 50.0


def test_binary_f1():
    ref = np.array([0.9, 0.9, 0.1, 0.1])
    assert acc.binary_f1(ref, ref) == 100.0
    assert acc.binary_f1(ref, np.array([0.9, 0.1, 0.9, 0.1])) == pytest.approx(50.0)  # 1 hit, 1 miss, 1 false
    assert acc.binary_f1(np.zeros(4), np.zeros(4)) == 100.0  # both empty
    assert acc.binary_f1(ref, np.zeros(4)) == 0.0


def test_cosine_and_retrieval_agreement():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((20, 8))
    assert acc.mean_cosine(ref, ref * 3) == pytest.approx(1.0)
    assert acc.mean_cosine(ref, -ref) == pytest.approx(-1.0)
    assert acc.retrieval_agreement(ref, 2 * ref) == 100.0
    nearest = acc.nearest_other(ref)
    assert (nearest != np.arange(20)).all()  # a row never retrieves itself
    shuffled = ref[rng.permutation(20)]
    assert acc.retrieval_agreement(ref, shuffled) < 100.0


def test_log_odds_is_the_logit_difference():
    logits = np.array([[0.0, 3.0], [2.0, -1.0], [0.0, 30.0]])
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(acc.log_odds(probs), logits[:, 1] - logits[:, 0], rtol=1e-9)


def test_gap_closed():
    assert acc.gap_closed(100.0, 80.0, 95.0) == pytest.approx(75.0)
    assert acc.gap_closed(100.0, 80.0, 70.0) == pytest.approx(-50.0)
    assert acc.gap_closed(100.0, 100.0, 100.0) is None
    assert acc.sqnr_gap_closed(20.0, 20.0) == pytest.approx(0.0)
    assert acc.sqnr_gap_closed(20.0, 30.0) == pytest.approx(90.0)  # a tenth of the error energy left
    assert acc.sqnr_gap_closed(20.0, math.inf) is None
    assert acc.metric_gap_closed("log-odds SQNR dB", math.inf, 20.0, 30.0) == pytest.approx(90.0)
    assert acc.metric_gap_closed("F1 %", 100.0, 80.0, 90.0) == pytest.approx(50.0)


def test_tables_show_errors_and_unknown_algorithms():
    fp32 = acc.Row("fp32", metrics={"F1 %": 100.0})
    rtn = acc.Row("W8A8 tensorrt", "rtn", 20.0, {"F1 %": 90.0}, 1.0)
    ada = acc.Row("W8A8 tensorrt", "adaround", 30.0, {"F1 %": 95.0}, 9.0)
    new = acc.Row("W8A8 tensorrt", "qdrop", error=acc.UNKNOWN_ALGO)
    table = acc.results_table([fp32, rtn, ada, new])
    assert "| W8A8 tensorrt | adaround | 30.00 | 95.0 | 9.0 |" in table
    assert f"| W8A8 tensorrt | qdrop | {acc.UNKNOWN_ALGO} |" in table
    gaps = acc.gap_table([fp32, rtn, ada, new])
    assert "| W8A8 tensorrt | adaround | 90.0 | 50.0 |" in gaps
    assert f"| W8A8 tensorrt | qdrop | {acc.UNKNOWN_ALGO} |" in gaps


def test_unknown_algorithm_is_not_an_error():
    assert acc.algo_problem("rtn") is None
    assert acc.algo_problem("no-such-algorithm") == acc.UNKNOWN_ALGO
