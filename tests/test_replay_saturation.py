"""Saturation with fractional GPUs kept (bench.replay_saturation): the three rules on tiny
hand-made workloads where the right placement is plain, and a run over the committed slice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import replay_saturation as rs  # noqa: E402
from bench.replay_trace import Trace, TraceTask, job_config, uniform_nodes  # noqa: E402

SAMPLE = ROOT / "tests" / "data" / "alibaba-gpu-2023-sample"


def trace(*shares: float, gpus_per_node: int = 2, nodes: int = 1) -> Trace:
    """Tasks asking for these shares of one GPU (1.0 or more: whole GPUs), in this order."""
    tasks = []
    for i, share in enumerate(shares):
        whole = share >= 1
        config = job_config(f"t{i}", 1, 1024, int(share) if whole else 1, None)
        tasks.append(TraceTask(f"t{i}", float(i), 10.0, config, 1000 if whole else round(share * 1000)))
    return Trace("hand-made", tasks, uniform_nodes(nodes, gpus_per_node, "V100", 64, 512 * 1024), [])


def test_whole_gpus_waste_what_sharing_keeps() -> None:
    t = trace(0.5, 0.5, 1, 0.5)
    whole = rs.saturate(t, "whole")
    # two halves take both GPUs; the whole-GPU task is refused: 1 of 2 GPUs asked, 50 % refused
    assert (whole.reached_at, whole.first_refusal) == (3, 3)
    assert whole.useful_share == 0.5 and whole.held_share == 1.0
    share = rs.saturate(t, "share")
    # the halves share GPU 0, the whole task takes GPU 1; the last half finds no room
    assert (share.first_refusal, share.reached_at) == (4, 4)
    assert share.useful_share == 1.0 and share.refused_share == pytest.approx(0.5 / 2.5)


def test_a_whole_gpu_task_never_lands_on_a_shared_gpu() -> None:
    assert rs.gpu_choices([500, 1000, 1000], rs.Ask(1, 100, 2, 1000, None, 2.0)) == [[1, 2]]
    assert rs.gpu_choices([500, 1000], rs.Ask(1, 100, 2, 1000, None, 2.0)) == []
    assert rs.gpu_choices([500, 1000, 1000], rs.Ask(1, 100, 1, 400, None, 0.4)) == [[0], [1]]
    assert rs.gpu_choices([500, 1000], rs.Ask(1, 100, 1, 600, None, 0.6)) == [[1]]


def test_fgd_leaves_no_sliver_where_best_fit_does() -> None:
    # After a half on GPU 0, best fit puts 0.3 beside it (0.2 left, which no task can use); the
    # 0.7 then takes GPU 1 and the last half is refused. FGD puts 0.3 on GPU 1 (0.7 left: the
    # 0.7-task fits there), and all four fit.
    t = trace(0.5, 0.3, 0.7, 0.5)
    share = rs.saturate(t, "share")
    assert share.first_refusal == 4 and share.useful_share == 0.75
    fgd = rs.saturate(t, "fgd")
    assert fgd.first_refusal is None and fgd.reached_at is None and fgd.useful_share == 1.0


def test_the_committed_slice_saturates_under_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert rs.main(["--trace", str(SAMPLE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_rule = {r["rule"]: r for r in report["rules"]}
    assert list(by_rule) == list(rs.RULES)
    assert by_rule["whole"]["reached_at"] is not None  # rounding up refuses 5 % within 300 tasks
    assert by_rule["share"]["useful_share"] > by_rule["whole"]["useful_share"]
    for r in by_rule.values():
        assert 0 < r["useful_share"] <= r["held_share"] <= 1
    assert rs.main(["--trace", str(SAMPLE), "--rules", "best"]) == 2
