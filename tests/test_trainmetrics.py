"""The training-metrics core (shared/trainmetrics.py): declarations, the line parser, the bounded
series; and the job config's `metrics` / `noProgressTimeoutSec` rules."""

from __future__ import annotations

import pytest

from muster.shared.jobconfig import check_job
from muster.shared.trainmetrics import (
    MAX_PER_METRIC,
    LinePicker,
    MetricFormat,
    MetricSpec,
    Series,
    parse_spec,
    shown,
)


@pytest.mark.parametrize(
    ("line", "points", "step"),
    [
        ("accuracy=0.93", [("accuracy", 0.93)], None),
        ("accuracy:0.93", [("accuracy", 0.93)], None),
        ("epoch 3 accuracy: 0.93, loss = 1.5e-2", [("accuracy", 0.93), ("loss", 0.015)], None),
        ("step=100 loss=0.31 accuracy=0.9", [("loss", 0.31), ("accuracy", 0.9)], 100),
        ("loss=0.31 step: 7", [("loss", 0.31)], 7),
        ("Train-accuracy=95.5", [("Train-accuracy", 95.5)], None),  # Arena's seed
        ("accuracy=-.5", [("accuracy", -0.5)], None),
        ("val_loss=0.2 val-loss=0.1 loss_x=3", [], None),  # glued to a longer name
        ("loss=0.3x accuracy=abc", [], None),  # not a number that ends there
        ("loss=nan accuracy=inf", [], None),
        ("no metrics here", [], None),
        ("step=1.5 loss=1", [("loss", 1.0)], None),  # a step is a whole number
        ("loss=1 loss=2", [("loss", 1.0), ("loss", 2.0)], None),
        ("", [], None),
    ],
)
def test_picks_declared_metrics_and_the_step_from_a_line(line, points, step):
    assert LinePicker(["accuracy", "loss", "Train-accuracy"]).pick(line) == (points, step)


def test_a_name_that_is_a_prefix_of_another_is_told_apart():
    picker = LinePicker(["acc", "acc-top5"])
    assert picker.pick("acc-top5=0.99 acc=0.8") == ([("acc-top5", 0.99), ("acc", 0.8)], None)


def test_undeclared_names_and_no_declarations_pick_nothing():
    assert LinePicker(["loss"]).pick("accuracy=0.9 step=3") == ([], 3)
    assert LinePicker([]).pick("loss=1") == ([], None)


def test_a_very_long_line_is_searched_only_at_its_start():
    assert LinePicker(["loss"]).pick("x" * 10_000 + " loss=1") == ([], None)


def test_declarations():
    assert parse_spec("accuracy:PERCENTAGE") == MetricSpec("accuracy", MetricFormat.PERCENTAGE)
    assert parse_spec("loss") == MetricSpec("loss", MetricFormat.RAW)
    assert parse_spec("loss:raw") == MetricSpec("loss", MetricFormat.RAW)
    for bad, why in [
        (":RAW", "needs a metric name"),
        ("loss:BYTES", "RAW or PERCENTAGE"),
        ("1loss", "must start with a letter"),
        ("lo ss", "must start with a letter"),
        ("step", "'step' is not a metric"),
        ("x" * 65, "at most 64"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_spec(bad)


def test_values_are_shown_as_declared():
    assert shown(0.93, MetricFormat.PERCENTAGE) == "93.00%"
    assert shown(93.0, MetricFormat.PERCENTAGE) == "93.00%"
    assert shown(0.3141592, MetricFormat.RAW) == "0.314159"


def test_the_series_keeps_latest_and_stays_bounded_for_a_fast_printer():
    s = Series()
    for i in range(10 * MAX_PER_METRIC):
        s.add(float(i), [("loss", float(i)), ("acc", -float(i))], i)
    points, dropped = s.take()
    assert len(points) <= 2 * MAX_PER_METRIC and dropped == 2 * 10 * MAX_PER_METRIC - len(points)
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    assert {p[2] for p in points} == {"loss", "acc"}  # thinning never drops a whole metric
    last = 10 * MAX_PER_METRIC - 1
    assert s.latest == {"loss": (last, last, "loss", last), "acc": (last, last, "acc", -last)}
    assert s.take() == ([], 0) and not s.changed
    s.add(1e9, [], None)  # output without a metric: only the clock moves
    assert s.changed and s.last_output == 1e9 and s.take() == ([], 0)


BASE = {
    "jobName": "m",
    "image": "img",
    "taskRoles": [
        {"name": "main", "taskNumber": 1, "cpuNumber": 1, "memoryMB": 100, "gpuNumber": 0, "command": "x"}
    ],
}


def errors(**fields):
    config, errs = check_job({**BASE, **fields})
    return [str(e) for e in errs] if config is None else []


def test_job_config_metrics_and_no_progress_timeout():
    config, errs = check_job(
        {**BASE, "metrics": ["accuracy:PERCENTAGE", "loss"], "noProgressTimeoutSec": 600}
    )
    assert not errs and config is not None
    assert config.metric_specs == [MetricSpec("accuracy", MetricFormat.PERCENTAGE), MetricSpec("loss")]
    assert errors(metrics=["loss", "acc:FOO"]) == [
        "metrics[1]: the format must be RAW or PERCENTAGE, got 'FOO'"
    ]
    assert errors(metrics=["loss", "loss:RAW"]) == [
        "metrics: 'loss' is declared twice (metrics[0] and metrics[1])"
    ]
    assert errors(metrics=[f"m{i}" for i in range(17)]) == ["metrics: must have at most 16 item(s)"]
    assert errors(metrics="loss") == ["metrics: must be a list, got 'loss'"]
    assert errors(metrics=[3]) == ["metrics[0]: must be a string, got 3"]
    assert errors(noProgressTimeoutSec=1) == ["noProgressTimeoutSec: must be ≥ 5, got 1"]
    assert errors(noProgressTimeoutSec="60") == ["noProgressTimeoutSec: must be an integer, got '60'"]


def test_the_published_schema_admits_metrics_and_the_no_progress_timeout():
    from tests.test_proto import _errors, _load

    schema = _load("jobconfig.schema.json")
    config = {**BASE, "metrics": ["accuracy:PERCENTAGE", "loss"], "noProgressTimeoutSec": 600}
    assert _errors(schema, schema, config) == []
    assert _errors(schema, schema, {**BASE, "noProgressTimeoutSec": 1}) != []
    assert _errors(schema, schema, {**BASE, "metrics": [f"m{i}" for i in range(17)]}) != []
