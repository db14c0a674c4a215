"""The CLI's formatting (services/cli/render.py): pure functions from records to text, no bus.
What `muster status`, `logs`, `metrics`, `vc` and the admin lists print is built here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.js.api import StreamConfig

from muster.services.cli import render
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    Dataset,
    GpuDevice,
    JobRecord,
    JobState,
    TaskState,
    TaskStatus,
    VirtualCluster,
)
from muster.shared.trainmetrics import MetricFormat

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)

CONFIG = {
    "jobName": "demo",
    "image": "python:3.11",
    "gpuType": "A100",
    "retryCount": -1,
    "metrics": ["accuracy:PERCENTAGE", "loss"],
    "taskRoles": [
        {"name": "ps", "taskNumber": 1, "cpuNumber": 2, "memoryMB": 512, "gpuNumber": 0, "command": "true"},
        {
            "name": "worker",
            "taskNumber": 2,
            "cpuNumber": 4,
            "memoryMB": 1024,
            "gpuNumber": 1,
            "command": "true",
            "image": "pytorch:2",
        },
    ],
}


def job(**fields: Any) -> JobRecord:
    return JobRecord(
        job_id="j1",
        job_name="demo",
        submission_id="s1",
        user="alice",
        config=JobConfig.model_validate(CONFIG),
        submitted_at=T0,
        updated_at=T0 + timedelta(seconds=5),
        **fields,
    )


def task(index: int, role: str = "worker", **fields: Any) -> TaskStatus:
    return TaskStatus(role=role, role_no=1 if role == "worker" else 0, index=index, **fields)


# ---------------------------------------------------------------- tables

COLUMNS = [
    ("one row", [("A", "B")], "A  B"),
    ("widest cell sets the width", [("A", "B"), ("long", "x")], "A     B\nlong  x"),
    (
        "last column not padded, trailing blanks stripped",
        [("A", "B", "C"), ("a", "bb", "")],
        "A  B   C\na  bb",
    ),
]


@pytest.mark.parametrize("rows,text", [c[1:] for c in COLUMNS], ids=[c[0] for c in COLUMNS])
def test_columns(rows: list[tuple[str, ...]], text: str) -> None:
    assert render.columns(rows) == text


def test_aligned_a_wider_cell_pushes_the_rest() -> None:
    assert render.aligned(("abcdef", "b", "c"), [2, 1]) == "abcdef  b  c"
    assert render.aligned(("a", "b", "c"), [2, 1]) == "a   b  c"


# ---------------------------------------------------------------- config checks

PROBLEMS = [
    ("path and reason", {"path": "taskRoles[0].name", "reason": "required"}, "taskRoles[0].name: required"),
    ("no path", {"path": "", "reason": "too big"}, "too big"),
    ("no path key", {"reason": "too big"}, "too big"),
    ("not a dict", "plain", "plain"),
]


@pytest.mark.parametrize("e,line", [p[1:] for p in PROBLEMS], ids=[p[0] for p in PROBLEMS])
def test_problem(e: Any, line: str) -> None:
    assert render.problem(e) == line


def test_rejection_counts_errors_in_words() -> None:
    one = render.rejection([{"path": "a", "reason": "b"}], "job.json")
    assert one == ["job.json: rejected, 1 error:", "  a: b"]
    two = render.rejection([{"reason": "x"}, {"reason": "y"}], "-")
    assert two == ["-: rejected, 2 errors:", "  x", "  y"]


# ---------------------------------------------------------------- jobs


def listed(state: str, reason: str = "why") -> dict[str, Any]:
    return {
        "job_id": "j1",
        "job_name": "demo",
        "state": state,
        "user": "alice",
        "vc": "default",
        "tasks": 3,
        "submitted_at": "2024-05-01T12:00:00.123456+00:00",
        "reason": reason,
    }


@pytest.mark.parametrize(
    "state,reason",
    [("WAITING", "why"), ("RUNNING", "why"), ("SUCCEEDED", ""), ("FAILED", ""), ("STOPPED", "")],
)
def test_job_row_shows_a_reason_only_while_live(state: str, reason: str) -> None:
    row = render.job_row(listed(state))
    assert row == ("j1", "demo", state, "alice", "default", "3", "2024-05-01 12:00:00", reason)
    assert len(row) == len(render.HEADER)


LISTING = [
    # (id, counts, shown, wanted, chosen, note)
    ("all shown", {"RUNNING": 2, "SUCCEEDED": 1}, 3, 3, False, None),
    (
        "default view left finished out",
        {"RUNNING": 2, "SUCCEEDED": 30, "FAILED": 0},
        22,
        22,
        False,
        "2 running, 30 succeeded; shown: the live jobs and the newest finished (--all, --state, --limit)",
    ),
    ("--state, all shown", {"RUNNING": 2, "SUCCEEDED": 30}, 30, 30, True, None),
    (
        "--limit cut a chosen list",
        {"RUNNING": 2, "SUCCEEDED": 3000},
        10,
        3002,
        True,
        "2 running, 3,000 succeeded; shown: the 10 newest of 3,002 (--limit)",
    ),
]


@pytest.mark.parametrize(
    "counts,shown,wanted,chosen,note", [r[1:] for r in LISTING], ids=[r[0] for r in LISTING]
)
def test_listing_note(
    counts: dict[str, int], shown: int, wanted: int, chosen: bool, note: str | None
) -> None:
    assert render.listing_note(counts, shown, wanted, chosen) == note


def test_describe_a_waiting_job_without_attempts() -> None:
    text = render.describe(job(reason="no node has 1 free A100"))
    assert text.splitlines() == [
        "job:        j1",
        "name:       demo",
        "state:      WAITING — no node has 1 free A100",
        "user:       alice",
        "image:      python:3.11",
        "submitted:  2024-05-01T12:00:00+00:00",
        "updated:    2024-05-01T12:00:05+00:00",
        "retries:    retry failures without limit",
        "attempt:    0 (retries charged 0, platform retries 0)",
        "tasks:      3",
        "  [0] ps ×1: 2 CPU, 512 MB, 0 GPU",
        "  [1] worker ×2: 4 CPU, 1024 MB, 1 GPU A100, image pytorch:2",
    ]
    assert render.describe(job(reason="x"), []) == text.replace("no node has 1 free A100", "x")


def test_describe_lists_each_attempt_and_the_current_ones_tasks() -> None:
    first = AttemptRecord(
        job_id="j1",
        attempt=1,
        placed_at=T0,
        ended_at=T0 + timedelta(minutes=1),
        outcome=JobState.FAILED,
        rule="any task failed",
        charged=True,
        tasks=[task(0, node="n1", state=TaskState.FAILED, exit_code=3), task(1, node="n2")],
    )
    second = AttemptRecord(
        job_id="j1",
        attempt=2,
        placed_at=T0 + timedelta(minutes=2),
        borrowed=True,
        tasks=[
            task(0, node="n2", gpus=[0, 1], state=TaskState.RUNNING),
            task(1, node="n1", reason="pulling"),
        ],
    )
    lines = render.describe(job(state=JobState.FAILED, attempt=2, retries=1), [first, second]).splitlines()
    assert lines[2] == "state:      FAILED"
    assert lines[12:] == [
        "attempt 1: 2024-05-01 12:00:00 on n1,n2, ended 12:01:00 FAILED: any task failed "
        "(retry charged to retryCount)",
        "    tasks: worker.0@n1 FAILED (3), worker.1@n2 PLACED",
        "attempt 2: 2024-05-01 12:02:00 on n1,n2 [borrowed capacity]",
        "  TASK      NODE  GPUS  STATE    EXIT  REASON",
        "  worker.0  n2    0,1   RUNNING",
        "  worker.1  n1    -     PLACED         pulling",
    ]


@pytest.mark.parametrize(
    "n,text", [(-1, "retry failures without limit"), (-2, "always restart until killed"), (0, "0"), (3, "3")]
)
def test_retry_text(n: int, text: str) -> None:
    assert render.retry_text(n) == text


def test_event_line() -> None:
    e = {
        "at": "2024-05-01T12:00:00.5+00:00",
        "kind": "placed",
        "state": "RUNNING",
        "attempt": 1,
        "detail": "on n1",
    }
    assert render.event_line(e) == "2024-05-01 12:00:00  placed    RUNNING   attempt 1  on n1"


def test_log_text_names_each_line() -> None:
    assert render.log_text([["worker.0", "hello"], ["ps.0", ""]]) == "[worker.0] hello\n[ps.0] \n"
    assert render.log_text([]) == ""


# ---------------------------------------------------------------- training metrics


def test_metric_line_under_its_header() -> None:
    p = {"t": "2024-05-01T12:00:00.123456+00:00", "name": "accuracy", "value": 0.5, "step": 10}
    line = render.metric_line("worker.0", p, MetricFormat.PERCENTAGE)
    assert line == "2024-05-01 12:00:00.123  worker.0            10  accuracy              50.00%"
    assert line.index("accuracy") == render.METRICS_HEADER.index("METRIC")
    no_step = render.metric_line("worker.0", {**p, "step": None, "name": "loss"}, MetricFormat.RAW)
    assert no_step.split()[3:] == ["-", "loss", "0.5"]


def test_metrics_table_latest_values_and_how_long_ago() -> None:
    latest = {
        "worker.1": {"latest": [], "last_output_at": None},
        "worker.0": {
            "latest": [
                {"name": "accuracy", "value": 0.25, "step": 7},
                {"name": "loss", "value": 1.5, "step": 9},
            ],
            "last_output_at": (T0 - timedelta(seconds=42)).isoformat(),
        },
    }
    text = render.metrics_table(job(attempt=2), latest, now=T0)
    assert text.splitlines() == [
        "metrics (attempt 2):",
        "  TASK      accuracy  loss  STEP  LAST OUTPUT",
        "  worker.0  25.00%    1.5   9     42s ago",
        "  worker.1  -         -     -     -",
    ]


# ---------------------------------------------------------------- cluster


def test_vc_usage_rows() -> None:
    rows = render.vc_usage_rows(
        [{"name": "a", "quota": "2xA100", "used": "1xA100", "borrowed": "-", "running": 1, "waiting": 0}]
    )
    assert rows == [
        ("VC", "QUOTA", "USED", "BORROWED", "RUNNING", "WAITING"),
        ("a", "2xA100", "1xA100", "-", "1", "0"),
    ]


VCS = [
    ("no quota", {}, "0 GPUs"),
    ("gpus", {"gpus": {"V100": 4, "T4": 2}}, "4xV100,2xT4"),
    ("all three", {"gpus": {"T4": 1}, "cpus": 8, "memory_mb": 4096}, "1xT4, 8 CPUs, 4096 MB"),
    ("zero cpus limits", {"cpus": 0}, "0 GPUs, 0 CPUs"),
]


@pytest.mark.parametrize("quota,text", [v[1:] for v in VCS], ids=[v[0] for v in VCS])
def test_vc_quota_text(quota: dict[str, Any], text: str) -> None:
    assert render.vc_quota_text(VirtualCluster(name="a", quota=quota)) == text


def test_vc_and_dataset_rows() -> None:
    vc = VirtualCluster(name="a", users=["alice", "bob"], max_priority="normal", borrow=False)
    assert render.vc_row(vc) == ("a", "0 GPUs", "alice,bob", "normal", "no")
    assert render.vc_row(VirtualCluster(name="b"))[2:] == ("*", "high", "yes")
    ds = Dataset(name="imagenet", source="/data/imagenet")
    assert render.dataset_row(ds) == ("imagenet", "/data/imagenet", "no", "*", "-")
    ds = Dataset(name="scratch", source="vol", writable=True, users=["alice"], description="tmp")
    assert render.dataset_row(ds) == ("scratch", "vol", "yes", "alice", "tmp")
    assert render.undecodable_row("x") == ("x", "(does not decode: ignored)", "-", "-", "-")


def test_stream_rows_only_musters_by_name() -> None:
    configs = [
        StreamConfig(name="MUSTER_LOGS", num_replicas=3, max_bytes=1024),
        StreamConfig(name="OTHER", num_replicas=1),
        StreamConfig(name="KV_muster_jobs", num_replicas=1, max_bytes=-1),
        StreamConfig(name="MUSTER_EVENTS", num_replicas=1, max_bytes=None),
        StreamConfig(name=None),
    ]
    assert render.stream_rows(configs) == [
        ("STREAM", "REPLICAS", "MAX BYTES"),
        ("KV_muster_jobs", "1", "-"),
        ("MUSTER_EVENTS", "1", "-"),
        ("MUSTER_LOGS", "3", "1024"),
    ]


def test_gpu_text() -> None:
    assert render.gpu_text([]) == "none"
    gpus = [
        GpuDevice(index=0, model="A100"),
        GpuDevice(index=1, model="T4"),
        GpuDevice(index=2, model="A100"),
    ]
    assert render.gpu_text(gpus) == "2xA100,1xT4"
