"""Issue 10: the trace replay with priorities, preemption and elastic jobs (bench/replay_sharing.py),
on the sample trace in tests/data. Deterministic: which jobs are elastic or high is a hash of their
names, and the replay runs in simulated time."""

from __future__ import annotations

import json

from bench.replay import SAMPLE_TRACE
from bench.replay_sharing import SCENARIOS, jobs_of, main, replay
from bench.replay_trace import load

MULTI = SAMPLE_TRACE / "openb_pod_list_multigpu50.csv"


def test_each_scenario_places_every_job_and_gives_every_gpu_back():
    trace = load(MULTI)
    jobs = jobs_of(trace, speedup=20000, elastic_share=0.5, high_share=0.1)
    assert sum(j.elastic for j in jobs) > 10 and sum(j.rank > 1 for j in jobs) > 10
    total = sum(len(n.gpus) for n in trace.nodes)
    runs = {name: replay(trace, jobs, name, dwell=30).report(total) for name in SCENARIOS}
    for r in runs.values():
        assert r["placed"] == len(jobs) and r["left_waiting"] == 0  # nobody starves
    assert runs["base"]["preemptions"] == runs["base"]["resizes"] == 0
    assert runs["preempt"]["preemptions"] > 0 and runs["preempt"]["resizes"] == 0
    assert runs["elastic"]["resizes"] > 0 and runs["elastic"]["preemptions"] == 0
    # Preemption serves high jobs first; elasticity shortens the wait of the rest.
    assert runs["preempt"]["high_queue_delay_s"]["mean"] < runs["base"]["high_queue_delay_s"]["mean"]
    assert runs["elastic"]["queue_delay_s"]["mean"] <= runs["base"]["queue_delay_s"]["mean"]


def test_the_command_prints_a_table_and_one_json_line(capsys):
    assert main(["--trace", str(MULTI), "--speedup", "20000", "--scenarios", "base,both"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["scenario", "GPU", "alloc"] and out[2].startswith("base")
    doc = json.loads(out[-1])
    assert doc["bench"] == "replay_sharing" and [r["scenario"] for r in doc["scenarios"]] == ["base", "both"]
    assert main(["--trace", str(MULTI), "--scenarios", "nope"]) == 2
