"""Metrics checked against values worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pilot_online.core.metrics import (
    accuracy_matrix,
    area_under_curve,
    average_accuracy,
    average_performance,
    class_forgetting,
    final_average_accuracy,
    final_task_accuracies,
    forgetting,
    per_class_accuracy,
    summarize,
    task_accuracies,
    task_gradient_norms,
)

NAN = np.nan

# Clear setting, 3 tasks. Column k = after task k.
CLEAR = np.array(
    [
        [90.0, 80.0, 70.0],
        [NAN, 85.0, 75.0],
        [NAN, NAN, 60.0],
    ]
)

# Si-Blurry-like, 4 tasks: task 1 exposed no new class (NaN row).
BLURRY = np.array(
    [
        [50.0, 60.0, 40.0, 45.0],
        [NAN, NAN, NAN, NAN],
        [NAN, NAN, 30.0, 35.0],
        [NAN, NAN, NAN, 80.0],
    ]
)


def test_average_accuracy_clear_by_hand():
    # A_0 = 90; A_1 = (80 + 85) / 2 = 82.5; A_2 = (70 + 75 + 60) / 3 = 205 / 3 = 68.333...
    np.testing.assert_allclose(average_accuracy(CLEAR), [90.0, 82.5, 205.0 / 3.0])


def test_average_performance_clear_by_hand():
    # AP = (90 + 82.5 + 68.333...) / 3 = 240.8333... / 3 = 80.2777...
    assert average_performance(CLEAR) == pytest.approx((90.0 + 82.5 + 205.0 / 3.0) / 3.0)
    assert average_performance(CLEAR) == pytest.approx(80.27777777777777)


def test_final_average_accuracy_and_task_accuracies_clear():
    # A_T = A_2 = 68.333...; per-task final accuracies = last column = [70, 75, 60].
    assert final_average_accuracy(CLEAR) == pytest.approx(68.33333333333333)
    np.testing.assert_allclose(final_task_accuracies(CLEAR), [70.0, 75.0, 60.0])


def test_forgetting_clear_by_hand():
    # task 0: max(90, 80) - 70 = 20; task 1: max(85) - 75 = 10; task 2 is the last -> excluded.
    # F = (20 + 10) / 2 = 15
    assert forgetting(CLEAR) == pytest.approx(15.0)


def test_forgetting_can_be_negative_when_final_improves():
    # task 0: max(50) - 70 = -20 ; only one earlier task -> F = -20
    acc = np.array([[50.0, 70.0], [NAN, 40.0]])
    assert forgetting(acc) == pytest.approx(-20.0)


def test_forgetting_needs_two_columns():
    acc = np.array([[90.0, NAN], [NAN, NAN]])  # only column 0 measured
    assert math.isnan(forgetting(acc))


def test_blurry_matrix_with_nan_row():
    # A_0 = 50; A_1 = 60 (task 1 row NaN, skipped); A_2 = (40 + 30) / 2 = 35;
    # A_3 = (45 + 35 + 80) / 3 = 160 / 3 = 53.333...
    np.testing.assert_allclose(average_accuracy(BLURRY), [50.0, 60.0, 35.0, 160.0 / 3.0])
    # AP = (50 + 60 + 35 + 53.333...) / 4 = 198.333... / 4 = 49.58333...
    assert average_performance(BLURRY) == pytest.approx(49.583333333333336)
    assert final_average_accuracy(BLURRY) == pytest.approx(53.333333333333336)
    # forgetting: task 0: max(50, 60, 40) - 45 = 15; task 1: NaN row, skipped;
    # task 2: max(30) - 35 = -5 ; F = (15 - 5) / 2 = 5
    assert forgetting(BLURRY) == pytest.approx(5.0)
    final = final_task_accuracies(BLURRY)
    assert final[0] == 45.0 and math.isnan(final[1]) and final[2] == 35.0 and final[3] == 80.0


def test_task_accuracies_by_hand_ignores_never_exposed_class():
    # classes 0,1 -> task 0 ; class 2 -> task 1 ; class 3 never exposed (-1) ; class 4 -> task 5
    # (beyond num_tasks=3, ignored). Task 2 has no samples -> NaN.
    class_task = np.array([0, 0, 1, -1, 5])
    y_true = np.array([0, 0, 1, 1, 2, 2, 2, 3, 3, 4])
    y_pred = np.array([0, 1, 1, 1, 2, 0, 0, 3, 3, 4])
    # task 0 samples: (0,0) ok, (0,1) wrong, (1,1) ok, (1,1) ok -> 3 / 4 = 75 %
    # task 1 samples: (2,2) ok, (2,0) wrong, (2,0) wrong       -> 1 / 3 = 33.333 %
    # class 3 and class 4 samples are ignored even though they are correct.
    result = task_accuracies(y_true, y_pred, class_task, num_tasks=3)
    assert result[0] == pytest.approx(75.0)
    assert result[1] == pytest.approx(100.0 / 3.0)
    assert math.isnan(result[2])


def test_task_accuracies_rejects_out_of_range_labels_and_logits():
    with pytest.raises(ValueError, match="class_task covers only"):
        task_accuracies([0, 3], [0, 3], [0, 0, 1], num_tasks=2)
    with pytest.raises(TypeError, match="argmax"):
        task_accuracies([0, 1], [0.2, 0.7], [0, 0], num_tasks=1)
    with pytest.raises(ValueError, match="same length"):
        task_accuracies([0, 1], [0], [0, 0], num_tasks=1)


def test_accuracy_matrix_masks_future_and_pads_missing_columns():
    # 3 tasks, run stopped after task 1: columns 0 and 1 measured, column 2 missing.
    # column 0 was measured with a (spurious) value for tasks 1 and 2 -> forced NaN.
    columns = [np.array([90.0, 11.0, 12.0]), np.array([80.0, 85.0, 13.0])]
    acc = accuracy_matrix(columns, num_tasks=3)
    expected = np.array([[90.0, 80.0, NAN], [NAN, 85.0, NAN], [NAN, NAN, NAN]])
    np.testing.assert_array_equal(acc, expected)
    # Metrics use the last measured column (1): A = [90, 82.5], AP = 86.25, A_T = 82.5,
    # forgetting = max(90) - 80 = 10.
    assert average_performance(acc) == pytest.approx(86.25)
    assert final_average_accuracy(acc) == pytest.approx(82.5)
    assert forgetting(acc) == pytest.approx(10.0)
    np.testing.assert_array_equal(final_task_accuracies(acc), [80.0, 85.0, NAN])


def test_accuracy_matrix_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="length num_tasks"):
        accuracy_matrix([np.array([1.0, 2.0])], num_tasks=3)
    with pytest.raises(ValueError, match="evaluation columns"):
        accuracy_matrix([np.zeros(1), np.zeros(1)], num_tasks=1)


def test_transposed_matrix_is_rejected():
    with pytest.raises(ValueError, match="transpose"):
        average_accuracy(CLEAR.T)
    with pytest.raises(ValueError, match="square"):
        average_accuracy(np.zeros((2, 3)))


def test_empty_matrix_gives_nan_not_warning():
    acc = np.full((2, 2), NAN)
    with np.errstate(all="raise"):
        assert math.isnan(average_performance(acc))
        assert math.isnan(final_average_accuracy(acc))
        assert math.isnan(forgetting(acc))


def test_class_forgetting_by_hand():
    # 3 end-of-task evaluations x 4 classes.
    history = np.array(
        [
            [80.0, NAN, NAN, NAN],
            [60.0, 90.0, NAN, NAN],
            [70.0, 50.0, 40.0, NAN],
        ]
    )
    # class 0: max(80, 60) - 70 = 10 ; class 1: max(90) - 50 = 40 ;
    # class 2: first seen at the last evaluation -> excluded ; class 3: never exposed -> excluded.
    # F_last = (10 + 40) / 2 = 25
    assert class_forgetting(history) == pytest.approx(25.0)
    assert math.isnan(class_forgetting(history[:1]))


def test_class_forgetting_counts_only_classes_with_a_positive_best_as_upstream_si_blurry():
    # 3 end-of-task evaluations x 6 classes (%). Upstream Si-Blurry keeps class j only if
    # max(cls_acc[:-1, j]) > 0 (unexposed classes score 0 there, NaN here).
    history = np.array(
        [
            [60.0, 40.0, 10.0, 0.0, NAN, NAN],
            [50.0, 20.0, 50.0, 0.0, NAN, NAN],
            [30.0, 20.0, 20.0, 30.0, NAN, 70.0],
        ]
    )
    # class 0: max(60, 50) - 30 = 30 ; class 1: max(40, 20) - 20 = 20 ;
    # class 2: max(10, 50) - 20 = 30 ; class 3: best earlier 0 -> left out (it would add
    # 0 - 30 = -30) ; class 4: never exposed ; class 5: first exposed at the last evaluation.
    # Upstream: (30 + 20 + 30) / 3 = 80 / 3 = 26.67.
    # Counting every class measured earlier (the old rule): (30 + 20 + 30 - 30) / 4 = 12.5.
    assert class_forgetting(history) == pytest.approx(80.0 / 3.0)
    # A class whose only earlier values are zeros or NaN never counts: nothing qualifies -> NaN.
    assert math.isnan(class_forgetting(np.array([[0.0, NAN], [0.0, NAN], [50.0, 60.0]])))
    # Improvement on a counted class is negative forgetting: max(10, 20) - 50 = -30.
    assert class_forgetting(np.array([[10.0], [20.0], [50.0]])) == pytest.approx(-30.0)


def test_area_under_curve_by_hand():
    # (10 + 20 + 60) / 3 = 30 ; NaN evaluations (nothing exposed yet) are skipped.
    assert area_under_curve([10.0, 20.0, 60.0]) == pytest.approx(30.0)
    assert area_under_curve([NAN, 10.0, 20.0, 60.0]) == pytest.approx(30.0)
    assert math.isnan(area_under_curve([]))


def test_per_class_accuracy_by_hand():
    y_true = np.array([0, 0, 0, 0, 2, 2])
    y_pred = np.array([0, 0, 0, 1, 2, 0])
    # class 0: 3 / 4 = 75 ; class 1: no samples -> NaN ; class 2: 1 / 2 = 50
    result = per_class_accuracy(y_true, y_pred, num_classes=3)
    assert result[0] == pytest.approx(75.0)
    assert math.isnan(result[1])
    assert result[2] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="num_classes"):
        per_class_accuracy([5], [5], num_classes=3)


def test_task_gradient_norms_by_hand():
    g = np.array([4.0, 2.0, 1.0, 3.0, NAN])
    # C_0 = {0, 1} -> G^0 = (4 + 2) / 2 = 3 ; C_1 = {2, 3} -> G^1 = (1 + 3) / 2 = 2 ;
    # C_2 = {1, 2, 4} (blurry: class 1 again; class 4 never trained, NaN skipped)
    #   -> G^2 = (2 + 1) / 2 = 1.5 ; C_3 = {} -> NaN.
    # max G = 3 -> G_n = [1, 2/3, 0.5, NaN]
    task_norm, normalised = task_gradient_norms(g, [[0, 1], [2, 3], [1, 2, 4], []])
    np.testing.assert_allclose(task_norm, [3.0, 2.0, 1.5, NAN])
    np.testing.assert_allclose(normalised, [1.0, 2.0 / 3.0, 0.5, NAN])
    with pytest.raises(ValueError, match="class ids"):
        task_gradient_norms(g, [[0, 7]])


def test_summarize_is_json_friendly():
    history = np.array([[80.0, NAN], [70.0, 50.0]])  # class 0: 80 - 70 = 10 ; class 1 excluded
    summary = summarize(
        BLURRY, periodic=[10.0, 20.0, 60.0], per_class_history=history, end_of_task=[50, 40, 30]
    )
    json.dumps(summary, allow_nan=False)  # raises if any NaN survived
    assert summary["accuracy_matrix"][1] == [None, None, None, None]
    assert summary["accuracy_matrix"][0] == [50.0, 60.0, 40.0, 45.0]
    assert summary["A_k"][2] == pytest.approx(35.0)
    assert summary["AP"] == pytest.approx(49.583333333333336)
    assert summary["A_T"] == pytest.approx(53.333333333333336)
    assert summary["final_task_accuracies"] == [45.0, None, 35.0, 80.0]
    assert summary["forgetting"] == pytest.approx(5.0)
    assert summary["A_auc"] == pytest.approx(30.0)
    assert summary["A_avg"] == pytest.approx(40.0)  # (50 + 40 + 30) / 3
    assert summary["A_last"] == pytest.approx(30.0)
    assert summary["F_last"] == pytest.approx(10.0)


def test_summarize_without_si_blurry_inputs():
    summary = summarize(CLEAR)
    assert summary["A_auc"] is None and summary["A_last"] is None and summary["F_last"] is None
    assert summary["forgetting"] == pytest.approx(15.0)
