"""Trace replay (bench.replay): exact outcomes on tiny handcrafted traces, the parsers' handling of
bad rows, the baselines' index against a plain pass, and a run over the committed Alibaba slice."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

from muster.services.scheduler.placement import NodeState, PendingJob, allocate
from muster.shared.messages import GpuDevice

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package; `python -m pytest` finds it anyway
    sys.path.insert(0, str(ROOT))

from bench import replay as rp  # noqa: E402
from bench.replay_policies import (  # noqa: E402
    LEVELS,
    POLICIES,
    LeastAttained,
    Need,
    NodeIndex,
    best_fit,
    first_fit,
    greedy_best_fit,
    greedy_first_fit,
    muster,
    strict_fifo,
)
from bench.replay_trace import TraceError, gpu_type_for, job_config, load, read_nodes  # noqa: E402
from bench.replay_workload import philly_like  # noqa: E402
from bench.replay_workload import write as write_workload  # noqa: E402

SAMPLE = ROOT / "tests" / "data" / "alibaba-gpu-2023-sample"
PHILLY = ROOT / "tests" / "data" / "philly-like" / "jobs-300-seed1.csv"


def write(path: Path, text: str) -> Path:
    path.write_text(text.strip() + "\n")
    return path


def nodes_csv(tmp_path: Path, *rows: str) -> Path:
    return write(tmp_path / "nodes.csv", "name,cpus,memory_mb,gpus,gpu_model\n" + "\n".join(rows))


def run(tmp_path: Path, tasks: str, nodes: Path, policy: str, speedup: float = 1.0) -> rp.Run:
    trace = load(write(tmp_path / "tasks.csv", tasks), nodes)
    return rp.replay(trace, POLICIES[policy](), speedup)


def starts(result: rp.Run) -> dict[str, float]:
    return dict(sorted(result.started.items()))


# ------------------------------------------------------------------ exact outcomes


BLOCKING = """
name,submit_time,duration,gpus
a,0,100,6
c,1,10,8
d,2,5,2
"""


def test_strict_fifo_holds_a_small_job_behind_a_big_one_muster_backfills_it(tmp_path: Path) -> None:
    # n1 has 8 GPUs, n2 4. a takes 6 of n1; c needs all 8 of one node, so only n1 once a ends;
    # d needs 2: n2 has them from the start.
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100", "n2,32,131072,4,V100")
    fifo = run(tmp_path, BLOCKING, nodes, "fifo")
    assert starts(fifo) == {"a": 0, "c": 100, "d": 100}
    mine = run(tmp_path, BLOCKING, nodes, "muster")
    assert starts(mine) == {"a": 0, "c": 100, "d": 2}  # backfilled, and c is not delayed by it
    assert sorted(mine.delays) == [0, 0, 99]
    assert sorted(fifo.delays) == [0, 98, 99]
    # Re-planned only when something arrived or freed with jobs waiting: 0, 1, 2, 7 (d ends while c
    # waits), 100; not at 110 (c ends, nobody waits).
    assert mine.replans == 5
    assert run(tmp_path, BLOCKING, nodes, "firstfit").started["d"] == 2


FRAGMENTING = """
name,submit_time,duration,gpus
a,0,100,2
b,1,10,8
"""


def test_first_fit_strands_gpus_that_best_fit_keeps_whole(tmp_path: Path) -> None:
    # n1 (8 GPUs) comes first by name: first fit puts a's 2 GPUs there, best fit on n2 (2 GPUs).
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100", "n2,32,131072,2,V100")
    first = run(tmp_path, FRAGMENTING, nodes, "firstfit")
    assert starts(first) == {"a": 0, "b": 100}
    report = first.report()
    # From 1 to 100, b waits while 6 GPUs are free on n1 and 2 on n2: no node can take 8.
    assert report["saturated_s"] == 99
    assert report["stranded_gpus_saturated"] == 8.0
    assert report["free_gpus_saturated"] == 8.0
    for policy in ("muster", "fifo"):
        packed = run(tmp_path, FRAGMENTING, nodes, policy)
        assert starts(packed) == {"a": 0, "b": 1}
        assert packed.report()["saturated_s"] == 0
        assert packed.report()["stranded_gpus_saturated"] is None


def test_a_job_that_can_never_fit_is_reported_with_musters_reason_and_blocks_nobody(tmp_path: Path) -> None:
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100")
    tasks = "name,submit_time,duration,gpus,gpu_model\nhuge,0,10,16,\nt4,0,10,1,T4\nsmall,1,10,1,"
    for policy in POLICIES:
        result = run(tmp_path, tasks, nodes, policy)
        assert starts(result) == {"small": 1}
        assert set(result.never) == {"huge", "t4"}
        assert "can never run on the current nodes" in result.never["huge"]
        assert "no node has a GPU of type T4" in result.never["t4"]


def test_gang_needs_and_speedup_compress_arrivals(tmp_path: Path) -> None:
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100")
    tasks = "name,submit_time,duration,gpus,cpus,memory_mb\na,0,50,8,4,2048\nb,100,50,8,4,2048"
    assert starts(run(tmp_path, tasks, nodes, "muster")) == {"a": 0, "b": 100}
    squeezed = run(tmp_path, tasks, nodes, "muster", speedup=10)  # b arrives at 10, waits for a
    assert starts(squeezed) == {"a": 0, "b": 50}
    assert squeezed.jcts == [50, 90]


def test_allocation_is_time_weighted_per_bucket_and_saturation_only_while_a_gpu_job_waits() -> None:
    meter = rp.Meter(total_gpus=10)
    meter.add(0, 3, used=5, saturated=False, stranded=0)
    meter.add(3, 10, used=10, saturated=True, stranded=0)
    meter.add(10, 14, used=2, saturated=True, stranded=6)
    assert meter.series(10, 5) == [0.7, 1.0]
    assert meter.series(14, 10) == [0.85, 0.2]  # the last bucket counts its own 4 s
    assert meter.saturated_s == 11 and meter.stranded_gpu_s == 24 and meter.free_gpu_s == 32


# ------------------------------------------------------------------ the baselines of issue 27

ONE_NODE = "n1,32,131072,8,V100"


def test_greedy_backfills_past_a_blocked_head_that_muster_and_fifo_reserve_for(tmp_path: Path) -> None:
    # a holds 4 of 8 GPUs until 100; b needs all 8; c fits beside a now, but runs until 202.
    tasks = "name,submit_time,duration,gpus\na,0,100,4\nb,1,10,8\nc,2,200,4"
    nodes = nodes_csv(tmp_path, ONE_NODE)
    assert starts(run(tmp_path, tasks, nodes, "greedy")) == {"a": 0, "b": 202, "c": 2}  # b pushed back
    for policy in ("muster-reserve", "fifo"):  # b's 4 claimed GPUs idle from 2 to 100
        assert starts(run(tmp_path, tasks, nodes, policy)) == {"a": 0, "b": 100, "c": 110}
    # Lending: c runs on b's claimed GPUs from 2, is stopped at 100 for b (which starts no later
    # than under the reservation) and runs its other 102 s from 110, its progress kept.
    mine = run(tmp_path, tasks, nodes, "muster")
    assert starts(mine) == {"a": 0, "b": 100, "c": 2}
    assert (mine.stops, mine.stopped_jobs) == (1, 1)
    assert sorted(mine.jcts) == [100, 109, 212 - 2]
    assert sorted(mine.delays) == [0, 212 - 2 - 200, 99]


def test_muster_las_stops_a_job_past_a_level_for_a_new_one_muster_keeps_arrival_order(tmp_path: Path) -> None:
    # a runs 8 GPUs for 10,000 s: past one GPU-hour (LEVELS[0]) after 450 s. b (8 GPUs, 10 s)
    # arrives at 1,000: first in least-attained order, it calls a back; under arrival order it
    # waits for a.
    assert LEVELS[0] == 3600
    tasks = "name,submit_time,duration,gpus\na,0,10000,8\nb,1000,10,8"
    nodes = nodes_csv(tmp_path, ONE_NODE)
    las = run(tmp_path, tasks, nodes, "muster-las")
    assert starts(las) == {"a": 0, "b": 1000} and las.stops == 1
    assert sorted(las.jcts) == [10, 10010]  # a resumed at 1,010 with its 1,000 s kept
    assert starts(run(tmp_path, tasks, nodes, "muster")) == {"a": 0, "b": 10000}


def test_oracle_sjf_runs_the_shortest_waiting_job_first(tmp_path: Path) -> None:
    tasks = "name,submit_time,duration,gpus\na,0,100,8\nb,1,50,8\nc,2,10,8"
    nodes = nodes_csv(tmp_path, ONE_NODE)
    assert starts(run(tmp_path, tasks, nodes, "greedy")) == {"a": 0, "b": 100, "c": 150}
    sjf = run(tmp_path, tasks, nodes, "sjf")
    assert starts(sjf) == {"a": 0, "b": 110, "c": 100}  # non-preemptive: a runs to its end
    assert sum(sjf.jcts) < sum(run(tmp_path, tasks, nodes, "greedy").jcts)


def test_las_stops_a_job_past_its_level_for_a_new_one_and_resumes_it_where_it_was(tmp_path: Path) -> None:
    # a takes all 8 GPUs for 20,000 s: past the first level (1 GPU-hour) at 450 s. b (100 s) comes
    # at 1,000: a is stopped, b runs 1,000-1,100, a resumes and ends 100 s late.
    nodes = nodes_csv(tmp_path, ONE_NODE)
    las = run(tmp_path, "name,submit_time,duration,gpus\na,0,20000,8\nb,1000,100,8", nodes, "las")
    assert starts(las) == {"a": 0, "b": 1000}
    assert las.jcts == [20100, 100] and las.delays == [100, 0]  # a's wait: its time not running
    assert (las.stops, las.stopped_jobs) == (1, 1)
    assert las.report()["active_s"] == 1100  # until a's restart, the last start
    greedy = run(tmp_path, "name,submit_time,duration,gpus\na,0,20000,8\nb,1000,100,8", nodes, "greedy")
    assert starts(greedy) == {"a": 0, "b": 20000}


def test_las_does_not_stop_a_job_of_the_same_level_until_it_climbs_one(tmp_path: Path) -> None:
    # b comes at 100, when a has 800 GPU-seconds: the same level, so b waits, until a reaches
    # 3,600 GPU-seconds at 450 s (a wake-up the policy asked for: nothing arrives or ends then).
    assert LEVELS[0] == 3600
    nodes = nodes_csv(tmp_path, ONE_NODE)
    las = run(tmp_path, "name,submit_time,duration,gpus\na,0,20000,8\nb,100,100,8", nodes, "las")
    assert starts(las) == {"a": 0, "b": 450}
    assert las.jcts == [20100, 450] and las.stops == 1


def test_las_stops_only_what_the_waiting_job_needs_and_leaves_the_nodes_as_they_were() -> None:
    nodes = {
        n: NodeState(n, 32, 131072, [GpuDevice(index=i, model="V100") for i in range(8)])
        for n in ("n1", "n2")
    }
    las = LeastAttained()
    old = [PendingJob(name, job_config(name, 1, 1024, 8, None)) for name in ("x", "y")]
    for job, node, at in zip(old, ("n1", "n2"), (0.0, 100.0), strict=True):
        specs = greedy_best_fit({node: nodes[node]}, [job])[job.job_id]
        allocate(nodes, job.config, specs)
        las.place(nodes, [])  # builds its index on these nodes
        las.clock = at
        las.started(job, specs)
    new = PendingJob("z", job_config("z", 1, 1024, 4, None))
    las.clock = 300.0  # x has run 2,400 GPU-seconds, y 1,600: level 0, as z: nobody is stopped
    assert las.place(nodes, [new]) == {} and las.stops == []
    las.clock = 1000.0  # x has run 8,000, y 7,200: both of level 1
    before = {n.name: set(n.used_gpus) for n in nodes.values()}
    decided = las.place(nodes, [new])
    assert list(decided) == ["z"] and las.stops == ["y"]  # one of the two, the newest start
    assert {spec.node for spec in decided["z"]} == {"n2"}
    assert {n.name: set(n.used_gpus) for n in nodes.values()} == before


def test_a_philly_row_of_more_gpus_than_a_node_is_a_gang_of_whole_nodes_and_a_bad_row_is_named(
    tmp_path: Path,
) -> None:
    tasks = write(
        tmp_path / "p.csv",
        "submit_time,duration,gpus,cpus\n0,10,16,32\n1,10,20,\n2,10,1.5,\n3,10,,\n4,ten,1,\n5,10,4,",
    )
    trace = load(tasks, None, rp.uniform_nodes(5, 8, "V100", 64, 512 * 1024))
    assert trace.skipped == [
        "p.csv line 4, column gpus: '1.5' is not a whole number",
        "p.csv line 5, column gpus: empty",
        "p.csv line 6, column duration: 'ten' is not a number",
    ]
    sixteen, twenty, four = trace.tasks
    shape = [(r.name, r.taskNumber, r.gpuNumber, r.cpuNumber) for r in sixteen.config.taskRoles]
    assert shape == [("task", 2, 8, 16)] and sixteen.gpus == 16
    assert [(r.name, r.taskNumber, r.gpuNumber) for r in twenty.config.taskRoles] == [
        ("task", 2, 8),
        ("rest", 1, 4),
    ]
    assert twenty.gpus == 20 and four.gpus == 4
    # the gangs hold 2 and 3 nodes at once, the 4-GPU job the half the 20-GPU gang leaves of one
    result = rp.replay(trace, POLICIES["greedy"]())
    assert starts(result) == {"job-000002": 0, "job-000003": 1, "job-000007": 5}
    # on 4 nodes the 20-GPU gang needs 3 whole or shared nodes while the first holds 2: it waits
    trace.nodes = rp.uniform_nodes(4, 8, "V100", 64, 512 * 1024)
    assert starts(rp.replay(trace, POLICIES["greedy"]()))["job-000003"] == 10


def test_the_committed_philly_sample_is_what_its_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "again.csv"
    with out.open("w") as f:
        write_workload(f, philly_like(300, seed=1))
    assert out.read_text() == PHILLY.read_text()
    gpus = Counter(int(line.split(",")[2]) for line in PHILLY.read_text().splitlines()[1:])
    assert gpus[1] > 150 and gpus[16] + gpus[32] > 5  # mostly 1 GPU, a few gangs


def test_the_philly_sample_replays_under_every_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert rp.main(["--trace", str(PHILLY), "--nodes", "8", "--policies", "all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_policy = {r["policy"]: r for r in report["policies"]}
    assert list(by_policy) == list(rp.BASELINES)
    for r in by_policy.values():
        assert r["placed"] == 300 and r["left_waiting"] == 0
        for figure in ("queue_delay_s", "jct_s"):
            f = r[figure]
            assert 0 <= f["p50"] <= f["p99"] <= f["max"] and f["mean"] <= f["max"]
        assert 0 < r["gpu_alloc_active"] <= 1 and 0 < r["saturated_share_active"] <= 1
        assert 0 < r["gpu_alloc_arrivals"] <= 1
        assert r["preemptions"] == 0 or r["policy"] in ("las", "muster", "muster-las", "muster-fifo-las")
    assert by_policy["las"]["preemptions"] > 0
    # Issue 27's targets, on this sample: lending the head's reservation (muster) against the
    # reservation that idles (muster-reserve), greedy backfill, oracle SJF and strict FIFO.
    mine, old = by_policy["muster"], by_policy["muster-reserve"]
    assert 0 < mine["preemptions"] < 300 * 0.05
    assert mine["jct_s"]["mean"] <= by_policy["greedy"]["jct_s"]["mean"]
    assert mine["jct_s"]["mean"] <= 2 * by_policy["sjf"]["jct_s"]["mean"]
    assert mine["jct_s"]["mean"] < old["jct_s"]["mean"] / 1.5
    assert mine["queue_delay_s"]["max"] <= by_policy["fifo"]["queue_delay_s"]["max"]
    assert mine["gpu_alloc_arrivals"] >= by_policy["greedy"]["gpu_alloc_arrivals"]
    assert mine["gpu_alloc_arrivals"] > old["gpu_alloc_arrivals"]
    # Least-attained order bounded by a FIFO shadow: the same four targets, at fewer stops per
    # job than plain least-attained order here, and a shorter mean completion time than muster's.
    bounded = by_policy["muster-fifo-las"]
    assert bounded["jct_s"]["mean"] <= by_policy["greedy"]["jct_s"]["mean"]
    assert bounded["jct_s"]["mean"] <= 2 * by_policy["sjf"]["jct_s"]["mean"]
    assert bounded["jct_s"]["mean"] < mine["jct_s"]["mean"]
    assert bounded["queue_delay_s"]["max"] <= by_policy["fifo"]["queue_delay_s"]["max"]
    assert bounded["gpu_alloc_arrivals"] >= by_policy["greedy"]["gpu_alloc_arrivals"]
    assert 0 < bounded["preemptions"] < by_policy["muster-las"]["preemptions"]
    # the oracle's mean completion time beats the same greedy packing in arrival order
    assert by_policy["sjf"]["jct_s"]["mean"] <= by_policy["greedy"]["jct_s"]["mean"]
    # every job runs exactly its duration: completion = wait + duration, stops or not
    total = sum(int(line.split(",")[1]) for line in PHILLY.read_text().splitlines()[1:])
    for r in by_policy.values():
        assert abs((r["jct_s"]["mean"] - r["queue_delay_s"]["mean"]) * 300 - total) < 300 * 0.2


# ------------------------------------------------------------------ parsers


def test_a_bad_row_is_skipped_and_named_not_a_crash(tmp_path: Path) -> None:
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100", "n2,x,131072,8,V100")
    tasks = write(
        tmp_path / "t.csv",
        "submit_time,duration,gpus,cpus\n0,10,1,2\n5,10,x,2\n6,-3,1,1\n7,10,1,2000\n8,10,1,",
    )
    trace = load(tasks, nodes)
    assert [t.name for t in trace.tasks] == ["job-000002", "job-000006"]  # named by line
    assert [n.name for n in trace.nodes] == ["n1"]
    assert trace.skipped == [
        "nodes.csv line 3, column cpus: 'x' is not a number",
        "t.csv line 3, column gpus: 'x' is not a number",
        "t.csv line 4, column duration: '-3' is not a finite number ≥ 0",
        "t.csv line 5, as a Muster job, taskRoles.0.cpuNumber: Input should be less than or equal to 1024",
    ]
    assert trace.tasks[1].config.taskRoles[0].cpuNumber == 1  # an empty cpus cell: the default


def test_a_file_that_cannot_be_replayed_says_why(tmp_path: Path) -> None:
    nodes = nodes_csv(tmp_path, "n1,32,131072,8,V100")
    with pytest.raises(TraceError, match=r"lacks column\(s\) duration"):
        load(write(tmp_path / "t.csv", "submit_time,gpus\n0,1"), nodes)
    with pytest.raises(TraceError, match="no such file"):
        load(tmp_path / "missing.csv", nodes)
    with pytest.raises(TraceError, match="no nodes given"):
        load(write(tmp_path / "t.csv", "submit_time,duration,gpus\n0,1,1"))
    with pytest.raises(TraceError, match="no nodes could be read"):
        read_nodes(nodes_csv(tmp_path, "n1,32,131072,8,"), [])


def test_alibaba_rows_map_to_muster_jobs(tmp_path: Path) -> None:
    header = (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
        "creation_time,deletion_time,scheduled_time"
    )
    write(
        tmp_path / "openb_pod_list_default.csv",
        f"""{header}
p0,12500,0,1,460,,LS,Running,10,110,20
p1,4000,8192,2,1000,V100M16|V100M32,LS,Pending,30,90,
p2,4000,8192,1,1000,G2|T4|V100M16|V100M32,LS,Running,40,30,40
p3,1000,x,1,1000,,LS,Running,50,60,50
""",
    )
    write(
        tmp_path / "openb_node_list_gpu_node.csv",
        "sn,cpu_milli,memory_mib,gpu,model\na,64000,262144,8,V100M32\nb,64000,262144,4,V100M16\n"
        "c,64000,262144,8,V100M32\nd,64000,262144,8,G2\n",
    )
    trace = load(tmp_path)
    p0, p1, p2 = trace.tasks
    role = p0.config.taskRoles[0]
    assert (role.cpuNumber, role.memoryMB, role.gpuNumber, p0.gpu_milli) == (13, 100, 1, 460)
    assert (p0.arrival, p0.duration, p1.duration, p1.timing, p2.duration, p2.clamped) == (
        10,
        90,
        60,
        "pending",
        0,
        True,
    )
    assert p1.config.gpuType == "V100M32"  # the allowed model with the most GPUs here
    assert p2.config.gpuType is None  # allows every model the cluster has
    assert trace.skipped == ["openb_pod_list_default.csv line 5, column memory_mib: 'x' is not a number"]
    adjust = rp.describe(trace, 1.0)
    assert adjust["fractional_tasks"] == 1
    assert adjust["rounding_gpu_h"] == round(0.54 * 90 / 3600, 1)
    assert adjust["narrowed_to_one_model"] == {"V100M16|V100M32 -> V100M32": 1}
    assert adjust["spec_allows_every_model"] == 1
    assert adjust["memory_raised_to_100mb"] == 1


def test_gpu_spec_rule() -> None:
    cluster = Counter({"G2": 4392, "T4": 842, "V100M16": 195, "V100M32": 204})
    assert gpu_type_for("", cluster) is None
    assert gpu_type_for("T4", cluster) == "T4"
    assert gpu_type_for("V100M16|V100M32|V100M32", cluster) == "V100M32"
    assert gpu_type_for("A10|T4", cluster) == "T4"  # A10 is not here
    assert gpu_type_for("A10", cluster) == "A10"  # kept: Muster will say it can never run
    assert gpu_type_for("G2|T4|V100M16|V100M32", cluster) is None


def test_a_pod_list_without_times_borrows_them_by_name_and_draws_the_rest_seeded() -> None:
    trace = load(SAMPLE / "openb_pod_list_multigpu50.csv")
    default = {t.name: t for t in load(SAMPLE).tasks}
    timing = Counter(t.timing for t in trace.tasks)
    assert (timing["borrowed"], timing["drawn"], len(trace.tasks)) == (250, 50, 300)
    for task in trace.tasks:
        if task.name in default:
            assert (task.arrival, task.duration) == (default[task.name].arrival, default[task.name].duration)
    again = load(SAMPLE / "openb_pod_list_multigpu50.csv")
    assert [(t.name, t.arrival, t.duration) for t in again.tasks] == [
        (t.name, t.arrival, t.duration) for t in trace.tasks
    ]
    assert any("has no times" in note for note in trace.notes)


# ------------------------------------------------------------------ the baselines' index


def random_nodes(rng: random.Random) -> dict[str, NodeState]:
    nodes = {}
    for i in range(rng.randint(1, 12)):
        count = rng.choice([0, 1, 2, 4, 8])
        model = rng.choice(["V100", "T4"])
        node = NodeState(
            f"n{rng.randint(0, 99):02d}-{i}",
            16,
            65536,
            [GpuDevice(index=k, model=model) for k in range(count)],
        )
        node.use(rng.randint(0, 16), rng.randint(0, 65536), rng.sample(range(count), rng.randint(0, count)))
        nodes[node.name] = node
    return nodes


def test_the_index_chooses_as_a_pass_over_the_nodes_would() -> None:
    rng = random.Random(7)
    for _ in range(300):
        nodes = random_nodes(rng)
        index = NodeIndex(nodes)
        ordered = sorted(nodes.values(), key=lambda n: n.name)
        for _ in range(5):
            need = Need(rng.choice([0, 1, 2, 4, 8]), rng.randint(1, 16), rng.randint(100, 65536), None)
            if need.gpus and rng.random() < 0.5:
                need = Need(need.gpus, need.cpus, need.memory_mb, rng.choice(["v100", "t4"]))
            assert index.best(need) is best_fit(ordered, need)
            assert index.first(need) is first_fit(ordered, need)


def test_policies_decide_without_changing_the_nodes() -> None:
    rng = random.Random(3)
    tasks = [("a", 8), ("b", 1), ("c", 2)]
    for _ in range(30):
        nodes = random_nodes(rng)
        before = {n.name: (n.used_cpus, n.used_memory_mb, set(n.used_gpus)) for n in nodes.values()}
        queue = [PendingJob(name, job_config(name, 1, 1024, gpus, None)) for name, gpus in tasks]
        for decide in (muster, strict_fifo, greedy_first_fit, greedy_best_fit):
            decide(nodes, queue)
            assert {
                n.name: (n.used_cpus, n.used_memory_mb, set(n.used_gpus)) for n in nodes.values()
            } == before


# ------------------------------------------------------------------ the real trace, a slice


def test_the_committed_alibaba_slice_replays_under_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert rp.main(["--trace", str(SAMPLE), "--speedup", "1000000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trace ") and "300 tasks; 51 nodes, 250 GPUs" in out[0]
    report = json.loads(out[-1])
    assert report["tasks"] == 300 and report["skipped_rows"] == 0
    assert report["fractional_tasks"] == 103
    by_policy = {r["policy"]: r for r in report["policies"]}
    assert set(by_policy) == {"muster", "fifo", "firstfit"}
    for r in by_policy.values():
        assert r["placed"] + r["never_placed"] == 300 and r["left_waiting"] == 0
        assert 0 < r["gpu_alloc_peak"] <= 1 and r["saturated_s"] > 0
        assert 0 <= r["queue_delay_s"]["p50"] <= r["queue_delay_s"]["p99"] <= r["queue_delay_s"]["max"]
        assert r["stranded_gpus_saturated"] <= r["free_gpus_saturated"]


def test_a_missing_trace_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(rp, "DEFAULT_TRACE", tmp_path / "nowhere")
    assert rp.main([]) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err
    assert rp.main(["--trace", str(tmp_path / "t.csv"), "--nodes", "2"]) == 2
    assert "t.csv: no such file" in capsys.readouterr().err


def test_a_simple_csv_on_uniform_nodes_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = write(tmp_path / "t.csv", "submit_time,duration,gpus\n0,10,8\n1,10,8\n2,10,4\n3,10,4")
    args = ["--trace", str(tasks), "--nodes", "1", "--gpus-per-node", "8", "--policies", "fifo", "--json"]
    assert rp.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1  # --json: only the JSON line
    # 0-10 the first; the second waits 9; the 4-GPU pair (waiting 18 and 17) share the node from 20
    (fifo,) = json.loads(out[0])["policies"]
    assert fifo["queue_delay_s"] == {"mean": 11.0, "p50": 9.0, "p99": 18.0, "max": 18.0}


def test_the_kept_core_starts_exactly_what_a_fresh_plan_per_decision_starts() -> None:
    """`muster` keeps one Cluster in step with the replay's commits; `muster_snapshot` rebuilds it
    from the nodes for every decision. Any drift in the kept index shows as a different start."""
    trace = load(SAMPLE, None)
    kept = rp.replay(trace, POLICIES["muster"](), 1000.0)
    fresh = rp.replay(trace, POLICIES["muster_snapshot"](), 1000.0)
    assert kept.started == fresh.started and len(kept.started) > 200
    strip = ("policy", "wall_s", "decide_s")
    assert {k: v for k, v in kept.report().items() if k not in strip} == {
        k: v for k, v in fresh.report().items() if k not in strip
    }
