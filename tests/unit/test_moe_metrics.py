"""The routing and per-expert statistics of the `moe` task on cases worked by hand, and the calibration
coverage schema it reads (`evalsuite.calibration-coverage/1`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from evalsuite.errors import InputError
from evalsuite.observers.boundary_states import FedOptions
from evalsuite.stats import metrics, tensor_errors
from evalsuite.tasks.moe import COVERAGE_SCHEMA, expert_count, read_coverage


def test_topk_overlap_counts_shared_experts_in_any_order():
    ref = np.array([[0, 1], [2, 3], [1, 0]])
    ckpt = np.array([[1, 0], [2, 0], [3, 2]])
    assert metrics.topk_overlap(ref, ckpt).tolist() == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError):
        metrics.topk_overlap(ref, ckpt[:, :1])


def test_mass_on_chosen_is_the_share_of_the_candidates_weight_on_the_references_experts():
    ref = np.array([[0, 1], [0, 1], [0, 1]])
    ckpt = np.array([[1, 0], [1, 3], [2, 3]])
    weights = np.array([[0.7, 0.3], [0.6, 0.2], [0.5, 0.5]])
    # row 1: 0.6 of 0.8 on expert 1, which the reference chose
    assert metrics.mass_on_chosen(weights, ckpt, ref) == pytest.approx([1.0, 0.75, 0.0])


def test_grouped_error_sums_weight_each_row_into_its_group():
    ref = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    cand = np.array([[1.0, 1.0], [0.0, 2.0], [3.0, 4.0]])
    out = tensor_errors.grouped_error_sums(ref, cand, [0.5, 0.25, 1.0], [1, 1, 0], 3)
    assert out[0].tolist() == [1, 1.0, 25.0, 0.0, 25.0, 25.0]
    # group 1: rows 0 (w 0.5, r·r 1, err 1, x·x 2, r·x 1) and 1 (w 0.25, r·r 4, exact)
    assert out[1].tolist() == [2, 0.75, 0.5 + 1.0, 0.5, 1.0 + 1.0, 0.5 + 1.0]
    assert out[2].tolist() == [0] * 6
    rel_err = math.sqrt(out[1, 3] / out[1, 2])
    assert rel_err == pytest.approx(math.sqrt(1 / 3))


def write(tmp_path, doc):
    path = tmp_path / "calibration_coverage.json"
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def test_coverage_reads_layer_dot_expert_counts(tmp_path):
    path = write(tmp_path, {"schema": COVERAGE_SCHEMA, "tokens": {"0.3": 12, "1.0": 0.5}})
    assert read_coverage(path, range(2), 4) == {(0, 3): 12.0, (1, 0): 0.5}


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ("{not json", "not readable JSON"),
        ({"tokens": {"0.1": 3}}, COVERAGE_SCHEMA),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"0-1": 3}}, "not LAYER.EXPERT"),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"2.1": 3}}, "the model lacks"),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"0.4": 3}}, "the model lacks"),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"0.1": -1}}, "not a count"),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"0.1": True}}, "not a count"),
        ({"schema": COVERAGE_SCHEMA, "tokens": {"0.1": "many"}}, "not a count"),
    ],
)
def test_a_malformed_coverage_file_is_refused_naming_it(tmp_path, doc, fragment):
    path = write(tmp_path, doc)
    with pytest.raises(InputError, match=fragment) as err:
        read_coverage(path, range(2), 4)
    assert str(path) in str(err.value)


def test_expert_count_reads_the_text_config_and_says_zero_for_a_dense_model():
    assert expert_count({"text_config": {"num_experts": 256}}) == 256
    assert expert_count({"num_local_experts": 8}) == 8
    assert expert_count({"hidden_size": 576}) == 0


@pytest.mark.parametrize(
    ("windows", "n_windows", "expected"),
    [
        (2, 8, (0, 7)),
        (4, 8, (0, 2, 5, 7)),
        (8, 8, tuple(range(8))),
        (9, 8, tuple(range(8))),
        (1, 8, (0,)),
        (2, 1, (0,)),
        (2, 3, (0, 2)),
    ],
)
def test_the_fed_windows_are_evenly_spread_and_never_more_than_the_protocol_has(windows, n_windows, expected):
    assert FedOptions(windows=windows).indices(n_windows) == expected


def test_a_fed_window_count_below_one_is_refused():
    with pytest.raises(ValueError, match="windows"):
        FedOptions(windows=0)
