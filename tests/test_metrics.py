"""Metrics of paper Sec. 5.1 and Appendix "Forgetting metric", checked on hand-computed 3x3 matrices."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from proteus.metrics import (
    accuracy,
    average_accuracy,
    confusion_matrix,
    final_average_accuracy,
    final_forgetting,
    forgetting,
    retrieval_accuracy,
    validate_matrix,
)

# rows = after task kappa; entry tau = acc(tau, kappa)
M = [[90.0], [80.0, 70.0], [60.0, 65.0, 50.0]]
M_FULL = [[90.0, None, None], [80.0, 70.0, None], [60.0, 65.0, 50.0]]
# backward transfer: accuracy on old tasks goes up
M_BWT = [[50.0], [60.0, 80.0], [70.0, 70.0, 90.0]]


def test_average_accuracy_hand_computed() -> None:
    # ACC_1 = 90; ACC_2 = (80 + 70) / 2; ACC_3 = (60 + 65 + 50) / 3
    assert average_accuracy(M) == pytest.approx([90.0, 75.0, 175.0 / 3.0])
    assert average_accuracy(M_FULL) == pytest.approx([90.0, 75.0, 175.0 / 3.0])
    assert final_average_accuracy(M) == pytest.approx(175.0 / 3.0)


def test_forgetting_hand_computed() -> None:
    # F_2 = acc(1,1) - acc(1,2) = 90 - 80 = 10
    # F_3 = 1/2 [ (max(90, 80) - 60) + (max(70) - 65) ] = 1/2 (30 + 5) = 17.5
    f = forgetting(M)
    assert f[0] is None
    assert f[1:] == pytest.approx([10.0, 17.5])
    assert forgetting(M_FULL)[1:] == pytest.approx([10.0, 17.5])
    assert final_forgetting(M) == pytest.approx(17.5)


def test_forgetting_max_ranges_only_where_defined() -> None:
    # F_2 = 50 - 60 = -10 (negative: backward transfer)
    # F_3 = 1/2 [ (max(50, 60) - 70) + (max(80) - 70) ] = 1/2 (-10 + 10) = 0
    # acc(2, 1) does not exist, so task 2's max only looks at tau' = 2
    assert forgetting(M_BWT)[1:] == pytest.approx([-10.0, 0.0])


def test_single_task_and_empty() -> None:
    assert forgetting([[42.0]]) == [None]
    assert final_forgetting([[42.0]]) is None
    assert final_forgetting([]) is None
    assert average_accuracy([[42.0]]) == [42.0]


def test_missing_entry_below_diagonal_raises() -> None:
    bad = [[90.0], [None, 70.0]]
    with pytest.raises(ValueError, match="task 1, after task 2"):
        average_accuracy(bad)
    with pytest.raises(ValueError):
        validate_matrix(bad)
    validate_matrix(M_FULL)


def test_results_round_trip_through_json() -> None:
    """What results.json stores: plain floats (or None), even from numpy/torch inputs, so a JSON round
    trip gives back the same values and types."""
    m32 = [[np.float32(v) for v in row] for row in M]
    res = {
        "avg_acc": average_accuracy(m32),
        "forgetting": forgetting(m32),
        "final_avg_acc": final_average_accuracy(m32),
        "final_forgetting": final_forgetting(m32),
        "accuracy": accuracy(torch.tensor([1, 0, 1, 0]), torch.tensor([1, 1, 1, 1])),
        "retrieval_accuracy": retrieval_accuracy(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1])),
    }
    back = json.loads(json.dumps(res))
    assert back == res
    assert back["avg_acc"] == pytest.approx([90.0, 75.0, 175.0 / 3.0]) and back["forgetting"][0] is None
    assert (back["accuracy"], back["retrieval_accuracy"]) == (50.0, 75.0)
    flat = [*res["avg_acc"], *res["forgetting"][1:], res["final_avg_acc"], res["final_forgetting"]]
    assert all(type(v) is float for v in [*flat, res["accuracy"], res["retrieval_accuracy"]])


def test_accuracy_percent() -> None:
    assert accuracy([1, 2, 3], [1, 2, 4]) == pytest.approx(200.0 / 3.0)
    assert accuracy(np.array([0, 0]), np.array([0, 0])) == 100.0
    assert accuracy(torch.tensor([1, 0, 1, 0]), torch.tensor([1, 1, 1, 1])) == 50.0
    assert retrieval_accuracy([0, 1, 2, 2], [0, 1, 2, 1]) == 75.0
    with pytest.raises(ValueError):
        accuracy([1, 2], [1])
    with pytest.raises(ValueError):
        accuracy([], [])


def test_confusion_matrix() -> None:
    cm = confusion_matrix([0, 1, 1, 2], [0, 1, 2, 2], 3)  # (retrieved, true)
    assert cm.tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]  # row = true task
    assert cm.dtype == np.int64
    with pytest.raises(ValueError):
        confusion_matrix([3], [0], 3)
