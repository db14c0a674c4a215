"""The job contract: the OpenPAI conformance corpus is accepted; every rule rejects with a path."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from muster.shared.jobconfig import FieldError, JobConfig, check_job
from muster.shared.loader import loads

CORPUS = Path(__file__).resolve().parent / "data" / "openpai-v1"  # copied from OpenPAI: see its README
CORPUS_FILES = sorted(CORPUS.glob("*.json"))

BASE: dict[str, Any] = {
    "jobName": "mnist-dist_1",
    "image": "openpai/pytorch:1.4-cuda10",
    "authFile": "hdfs://auth/registry.txt",
    "dataDir": "hdfs://data/mnist",
    "outputDir": "hdfs://output/mnist",
    "codeDir": "$PAI_DEFAULT_FS_URI/code",
    "taskRoles": [
        {
            "name": "master",
            "taskNumber": 1,
            "cpuNumber": 2,
            "memoryMB": 4096,
            "gpuNumber": 1,
            "command": "python train.py --rank 0",
        },
        {
            "name": "worker",
            "taskNumber": 2,
            "cpuNumber": 2,
            "memoryMB": 4096,
            "gpuNumber": 1,
            "command": "python train.py",
            "shmMB": 1024,
            "minFailedTaskCount": 1,
            "minSucceededTaskCount": 2,
            "portList": [{"label": "http", "beginAt": 0, "portNumber": 1}],
        },
    ],
    "gpuType": "V100",
    "killAllOnCompletedTaskNumber": 1,
    "retryCount": 0,
    "virtualCluster": "default",
    "jobEnvs": {"EPOCHS": "10", "LR": 0.1, "DEBUG": False, "SEED": 7},
    "extras": {"submitFrom": "cli"},
}

_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parse(path: str) -> list[str | int]:
    return [key if key else int(idx) for key, idx in _SEGMENT.findall(path)]


def mutate(path: str, value: Any) -> dict[str, Any]:
    """A copy of BASE with `value` set at `path` (`taskRoles[1].memoryMB`)."""
    cfg = copy.deepcopy(BASE)
    *parents, last = _parse(path)
    node: Any = cfg
    for part in parents:
        node = node[part]
    node[last] = value
    return cfg


def delete(path: str) -> dict[str, Any]:
    """A copy of BASE without the key at `path`."""
    cfg = copy.deepcopy(BASE)
    *parents, last = _parse(path)
    node: Any = cfg
    for part in parents:
        node = node[part]
    del node[last]
    return cfg


def whole(value: Any) -> Any:
    return value


def role(**fields: Any) -> dict[str, Any]:
    return {
        "name": "r",
        "taskNumber": 1,
        "cpuNumber": 1,
        "memoryMB": 100,
        "gpuNumber": 0,
        "command": "true",
        **fields,
    }


PATTERN_NAME = "must start with a letter or digit and use only letters, digits, '_' and '-'"
PATTERN_IDENT = "must start with a letter or '_' and use only letters, digits and '_'"
PATTERN_IMAGE = "must be a Docker image reference"
DOTDOT = "must not contain a '..' path segment"


def row(rid: str, cfg: Any, path: str, reason: str) -> Any:
    return pytest.param(cfg, path, reason, id=rid)


# One row per rule: (id, config, path that must be reported, substring of its reason).
TABLE = [
    # required fields
    row("missing-jobName", delete("jobName"), "jobName", "required"),
    row("missing-image", delete("image"), "image", "required"),
    row("missing-taskRoles", delete("taskRoles"), "taskRoles", "required"),
    row("missing-role-name", delete("taskRoles[1].name"), "taskRoles[1].name", "required"),
    row("missing-taskNumber", delete("taskRoles[1].taskNumber"), "taskRoles[1].taskNumber", "required"),
    row("missing-cpuNumber", delete("taskRoles[0].cpuNumber"), "taskRoles[0].cpuNumber", "required"),
    row("missing-memoryMB", delete("taskRoles[1].memoryMB"), "taskRoles[1].memoryMB", "required"),
    row("missing-gpuNumber", delete("taskRoles[0].gpuNumber"), "taskRoles[0].gpuNumber", "required"),
    row("missing-command", delete("taskRoles[1].command"), "taskRoles[1].command", "required"),
    # strict types
    row("jobName-int", mutate("jobName", 42), "jobName", "must be a string, got 42"),
    row("image-null", mutate("image", None), "image", "must be a string, got null"),
    row(
        "taskNumber-str",
        mutate("taskRoles[1].taskNumber", "2"),
        "taskRoles[1].taskNumber",
        "must be an integer, got '2'",
    ),
    row(
        "cpuNumber-bool",
        mutate("taskRoles[0].cpuNumber", True),
        "taskRoles[0].cpuNumber",
        "must be an integer, got true",
    ),
    row(
        "memoryMB-float",
        mutate("taskRoles[1].memoryMB", 1024.0),
        "taskRoles[1].memoryMB",
        "must be an integer, got 1024.0",
    ),
    row(
        "gpuNumber-null",
        mutate("taskRoles[0].gpuNumber", None),
        "taskRoles[0].gpuNumber",
        "must be a number of GPUs (0 to 64, or 0.01 to 0.99 of one GPU), got null",
    ),
    row(
        "gpuNumber-one-and-a-half",
        mutate("taskRoles[0].gpuNumber", 1.5),
        "taskRoles[0].gpuNumber",
        "a task asks for whole GPUs, or for part of one GPU (0.01 to 0.99), got 1.5",
    ),
    row(
        "gpuNumber-thousandth",
        mutate("taskRoles[0].gpuNumber", 0.005),
        "taskRoles[0].gpuNumber",
        "part of a GPU is given in hundredths (0.01 to 0.99), got 0.005",
    ),
    row(
        "gpuNumber-65", mutate("taskRoles[0].gpuNumber", 65), "taskRoles[0].gpuNumber", "must be ≤ 64, got 65"
    ),
    row(
        "command-list",
        mutate("taskRoles[0].command", ["python", "x.py"]),
        "taskRoles[0].command",
        "must be a string, got a list",
    ),
    row("retryCount-str", mutate("retryCount", "1"), "retryCount", "must be an integer, got '1'"),
    row(
        "killAll-bool",
        mutate("killAllOnCompletedTaskNumber", False),
        "killAllOnCompletedTaskNumber",
        "must be an integer, got false",
    ),
    row("authFile-int", mutate("authFile", 3), "authFile", "must be a string, got 3"),
    row("gpuType-int", mutate("gpuType", 100), "gpuType", "must be a string, got 100"),
    # numeric bounds
    row(
        "taskNumber-0", mutate("taskRoles[1].taskNumber", 0), "taskRoles[1].taskNumber", "must be ≥ 1, got 0"
    ),
    row(
        "taskNumber-huge",
        mutate("taskRoles[1].taskNumber", 10_001),
        "taskRoles[1].taskNumber",
        "must be ≤ 10000, got 10001",
    ),
    row("cpuNumber-0", mutate("taskRoles[0].cpuNumber", 0), "taskRoles[0].cpuNumber", "must be ≥ 1, got 0"),
    row("memoryMB-99", mutate("taskRoles[1].memoryMB", 99), "taskRoles[1].memoryMB", "must be ≥ 100, got 99"),
    row(
        "gpuNumber-negative",
        mutate("taskRoles[0].gpuNumber", -1),
        "taskRoles[0].gpuNumber",
        "must be ≥ 0, got -1",
    ),
    row("retryCount-minus3", mutate("retryCount", -3), "retryCount", "must be ≥ -2, got -3"),
    row("maxRunTimeSec-0", mutate("maxRunTimeSec", 0), "maxRunTimeSec", "must be ≥ 1, got 0"),
    row("maxRunTimeSec-str", mutate("maxRunTimeSec", "60"), "maxRunTimeSec", "must be an integer, got '60'"),
    row("resumable-str", mutate("resumable", "yes"), "resumable", "must be true or false, got 'yes'"),
    row(
        "maxRunTimeSec-over-a-year",
        mutate("maxRunTimeSec", 365 * 24 * 3600 + 1),
        "maxRunTimeSec",
        "must be ≤ 31536000, got 31536001",
    ),
    row(
        "killAll-negative",
        mutate("killAllOnCompletedTaskNumber", -1),
        "killAllOnCompletedTaskNumber",
        "must be ≥ 0, got -1",
    ),
    row(
        "killAll-over-total",
        mutate("killAllOnCompletedTaskNumber", 4),
        "killAllOnCompletedTaskNumber",
        "must be ≤ the job's total tasks (3), got 4",
    ),
    # command
    row("command-empty", mutate("taskRoles[1].command", ""), "taskRoles[1].command", "must not be empty"),
    row(
        "command-whitespace",
        mutate("taskRoles[1].command", "  \t\n "),
        "taskRoles[1].command",
        "must not be empty",
    ),
    row("command-nul", mutate("taskRoles[0].command", "echo a\x00b"), "taskRoles[0].command", "NUL"),
    # role names
    row(
        "role-name-duplicate",
        mutate("taskRoles[1].name", "master"),
        "taskRoles[1].name",
        "duplicate role name 'master' (also taskRoles[0])",
    ),
    row("role-name-hyphen", mutate("taskRoles[1].name", "ps-server"), "taskRoles[1].name", PATTERN_IDENT),
    row(
        "role-name-leading-digit", mutate("taskRoles[1].name", "1worker"), "taskRoles[1].name", PATTERN_IDENT
    ),
    row("role-name-empty", mutate("taskRoles[0].name", ""), "taskRoles[0].name", "must not be empty"),
    # min*TaskCount
    row(
        "minSucceeded-over-taskNumber",
        mutate("taskRoles[1].minSucceededTaskCount", 3),
        "taskRoles[1].minSucceededTaskCount",
        "must be ≤ taskNumber (2), got 3",
    ),
    row(
        "minSucceeded-0",
        mutate("taskRoles[1].minSucceededTaskCount", 0),
        "taskRoles[1].minSucceededTaskCount",
        "must be ≥ 1, got 0",
    ),
    row(
        "minFailed-over-taskNumber",
        mutate("taskRoles[1].minFailedTaskCount", 5),
        "taskRoles[1].minFailedTaskCount",
        "must be ≤ taskNumber (2), got 5",
    ),
    row(
        "minFailed-0",
        mutate("taskRoles[1].minFailedTaskCount", 0),
        "taskRoles[1].minFailedTaskCount",
        "must be ≥ 1, got 0",
    ),
    # shmMB
    row(
        "shmMB-over-memoryMB",
        mutate("taskRoles[1].shmMB", 4097),
        "taskRoles[1].shmMB",
        "must be ≤ memoryMB (4096), got 4097",
    ),
    row("shmMB-0", mutate("taskRoles[1].shmMB", 0), "taskRoles[1].shmMB", "must be ≥ 1, got 0"),
    # portList
    row(
        "port-label-hyphen",
        mutate("taskRoles[1].portList[0].label", "my-port"),
        "taskRoles[1].portList[0].label",
        PATTERN_IDENT,
    ),
    row(
        "port-label-duplicate",
        mutate(
            "taskRoles[1].portList",
            [
                {"label": "http", "beginAt": 0, "portNumber": 1},
                {"label": "http", "beginAt": 8080, "portNumber": 2},
            ],
        ),
        "taskRoles[1].portList[1].label",
        "duplicate port label 'http'",
    ),
    row(
        "portNumber-0",
        mutate("taskRoles[1].portList[0].portNumber", 0),
        "taskRoles[1].portList[0].portNumber",
        "must be ≥ 1, got 0",
    ),
    row(
        "beginAt-65536",
        mutate("taskRoles[1].portList[0].beginAt", 65536),
        "taskRoles[1].portList[0].beginAt",
        "must be ≤ 65535, got 65536",
    ),
    row(
        "beginAt-negative",
        mutate("taskRoles[1].portList[0].beginAt", -1),
        "taskRoles[1].portList[0].beginAt",
        "must be ≥ 0, got -1",
    ),
    row(
        "port-range-past-65535",
        mutate("taskRoles[1].portList[0]", {"label": "http", "beginAt": 65530, "portNumber": 10}),
        "taskRoles[1].portList[0].portNumber",
        "ports 65530..65539 run past 65535",
    ),
    row(
        "portList-not-list",
        mutate("taskRoles[1].portList", {"label": "http"}),
        "taskRoles[1].portList",
        "must be a list, got an object",
    ),
    row(
        "port-missing-label",
        delete("taskRoles[1].portList[0].label"),
        "taskRoles[1].portList[0].label",
        "required",
    ),
    # jobName
    row("jobName-space", mutate("jobName", "my job"), "jobName", PATTERN_NAME),
    row("jobName-dot", mutate("jobName", "my.job"), "jobName", PATTERN_NAME),
    row("jobName-slash", mutate("jobName", "team/job"), "jobName", PATTERN_NAME),
    row("jobName-leading-dash", mutate("jobName", "-job"), "jobName", PATTERN_NAME),
    row("jobName-trailing-newline", mutate("jobName", "job\n"), "jobName", PATTERN_NAME),
    row("jobName-65-chars", mutate("jobName", "j" * 65), "jobName", "must be at most 64 characters, got 65"),
    row("jobName-empty", mutate("jobName", ""), "jobName", "must not be empty"),
    # image
    row("image-empty", mutate("image", ""), "image", "must not be empty"),
    row("image-space", mutate("image", "ubuntu latest"), "image", PATTERN_IMAGE),
    row("image-uppercase-repo", mutate("image", "Team/Image"), "image", PATTERN_IMAGE),
    row("image-empty-tag", mutate("image", "ubuntu:"), "image", PATTERN_IMAGE),
    row("image-bad-digest", mutate("image", "ubuntu@sha256:xyz"), "image", PATTERN_IMAGE),
    row("image-shell", mutate("image", "ubuntu;rm -rf /"), "image", PATTERN_IMAGE),
    # paths
    row("authFile-dotdot", mutate("authFile", "hdfs://auth/../secret"), "authFile", DOTDOT),
    row("dataDir-dotdot", mutate("dataDir", "../data"), "dataDir", DOTDOT),
    row("outputDir-dotdot", mutate("outputDir", "/out/.."), "outputDir", DOTDOT),
    row("codeDir-dotdot", mutate("codeDir", "code/../../etc"), "codeDir", DOTDOT),
    row("codeDir-dotdot-backslash", mutate("codeDir", "code\\..\\etc"), "codeDir", DOTDOT),
    row("dataDir-nul", mutate("dataDir", "/data\x00/x"), "dataDir", "must not contain a NUL character"),
    row(
        "outputDir-too-long",
        mutate("outputDir", "/" + "o" * 4096),
        "outputDir",
        "must be at most 4096 characters, got 4097",
    ),
    # gpuType, virtualCluster
    row(
        "gpuType-space",
        mutate("gpuType", "Tesla V100"),
        "gpuType",
        "must use only letters, digits, '.', '_' and '-'",
    ),
    row("virtualCluster-slash", mutate("virtualCluster", "vc/a"), "virtualCluster", PATTERN_NAME),
    # jobEnvs
    row("jobEnvs-key-hyphen", mutate("jobEnvs", {"MY-VAR": "1"}), "jobEnvs.MY-VAR", PATTERN_IDENT),
    row("jobEnvs-key-leading-digit", mutate("jobEnvs", {"1VAR": "1"}), "jobEnvs.1VAR", PATTERN_IDENT),
    # PAI_ names are accepted with a warning, as OpenPAI did (tests/test_contract.py).
    row(
        "jobEnvs-reserved-MUSTER",
        mutate("jobEnvs", {"MUSTER_TOKEN": "x"}),
        "jobEnvs.MUSTER_TOKEN",
        "names starting with MUSTER_ are set by the platform",
    ),
    row(
        "jobEnvs-value-list",
        mutate("jobEnvs.EPOCHS", [10]),
        "jobEnvs.EPOCHS",
        "must be a string, number or true/false, got a list",
    ),
    row(
        "jobEnvs-value-object",
        mutate("jobEnvs.EPOCHS", {"n": 10}),
        "jobEnvs.EPOCHS",
        "must be a string, number or true/false, got an object",
    ),
    row(
        "jobEnvs-value-null",
        mutate("jobEnvs.EPOCHS", None),
        "jobEnvs.EPOCHS",
        "must be a string, number or true/false, got null",
    ),
    row(
        "jobEnvs-value-nan",
        mutate("jobEnvs.LR", float("nan")),
        "jobEnvs.LR",
        "must be a finite number, got nan",
    ),
    row("jobEnvs-not-object", mutate("jobEnvs", ["A=1"]), "jobEnvs", "must be an object, got a list"),
    # extras
    row("extras-list", mutate("extras", [1, 2]), "extras", "must be an object, got a list"),
    row("extras-string", mutate("extras", "x"), "extras", "must be an object, got 'x'"),
    # unknown fields
    row("unknown-top-level", mutate("jobname", "typo"), "jobname", "unknown field"),
    row("unknown-role-field", mutate("taskRoles[0].gpus", 2), "taskRoles[0].gpus", "unknown field"),
    row(
        "unknown-port-field",
        mutate("taskRoles[1].portList[0].protocol", "tcp"),
        "taskRoles[1].portList[0].protocol",
        "unknown field",
    ),
    # taskRoles shape
    row("taskRoles-empty", mutate("taskRoles", []), "taskRoles", "must have at least 1 item(s), got 0"),
    row(
        "taskRoles-object",
        mutate("taskRoles", {"name": "worker"}),
        "taskRoles",
        "must be a list, got an object",
    ),
    row("taskRoles-string", mutate("taskRoles", "worker"), "taskRoles", "must be a list, got 'worker'"),
    row(
        "taskRoles-too-many",
        mutate("taskRoles", [role(name=f"r{i}") for i in range(65)]),
        "taskRoles",
        "must have at most 64 item(s)",
    ),
    row(
        "role-not-object", mutate("taskRoles[1]", "worker"), "taskRoles[1]", "must be an object, got 'worker'"
    ),
    row("role-null", mutate("taskRoles[0]", None), "taskRoles[0]", "must be an object, got null"),
    # the config itself
    row("config-list", whole([BASE]), "", "a job config must be a JSON object, got a list"),
    row("config-string", whole("jobName: x"), "", "a job config must be a JSON object, got a string"),
    row("config-null", whole(None), "", "a job config must be a JSON object, got null"),
    row("config-number", whole(3), "", "a job config must be a JSON object, got a number"),
]


def test_table_has_a_row_per_rule() -> None:
    assert len(TABLE) >= 45
    assert len({p.id for p in TABLE}) == len(TABLE)


def test_base_config_is_valid() -> None:
    config, errors = check_job(copy.deepcopy(BASE))
    assert errors == []
    assert config is not None
    assert config.total_tasks == 3
    assert config.role("worker").portList[0].label == "http"


@pytest.mark.parametrize(("cfg", "path", "reason"), TABLE)
def test_invalid_config_is_rejected_at_path(cfg: Any, path: str, reason: str) -> None:
    config, errors = check_job(cfg)
    assert config is None
    assert errors, "a rejected config must say why"
    shown = [str(e) for e in errors]
    at_path = [e for e in errors if e.path == path]
    assert at_path, f"no error at {path!r}; got {shown}"
    assert any(reason in e.reason for e in at_path), f"{reason!r} not in {shown}"
    # Each row breaks exactly one rule, so nothing else is reported.
    assert {e.path for e in errors} == {path}, shown


def test_all_errors_reported_in_one_verdict() -> None:
    cfg = mutate("taskRoles[1].memoryMB", 64)
    cfg["jobName"] = "bad name"
    cfg["retryCount"] = -3
    cfg["taskRoles"][0]["name"] = "worker"  # duplicate of taskRoles[1]
    config, errors = check_job(cfg)
    assert config is None
    by_path = {e.path: e for e in errors}
    assert set(by_path) == {
        "jobName",
        "retryCount",
        "taskRoles[1].memoryMB",
        "taskRoles[1].name",
    }
    assert str(by_path["taskRoles[1].memoryMB"]) == "taskRoles[1].memoryMB: must be ≥ 100, got 64"
    assert str(by_path["retryCount"]) == "retryCount: must be ≥ -2, got -3"
    assert str(by_path["taskRoles[1].name"]) == (
        "taskRoles[1].name: duplicate role name 'worker' (also taskRoles[0])"
    )
    assert len(errors) == len(by_path), "one error per broken rule, no duplicates"


def test_whole_config_error_has_no_path_prefix() -> None:
    _, errors = check_job([])
    assert errors == [FieldError(path="", reason="a job config must be a JSON object, got a list")]
    assert str(errors[0]) == "a job config must be a JSON object, got a list"


def test_field_error_format() -> None:
    err = FieldError(path="taskRoles[1].memoryMB", reason="must be ≥ 100, got 64")
    assert str(err) == "taskRoles[1].memoryMB: must be ≥ 100, got 64"


@pytest.mark.parametrize("field", ["authFile", "dataDir", "outputDir", "codeDir", "gpuType"])
def test_empty_string_means_unset(field: str) -> None:
    config, errors = check_job(mutate(field, ""))
    assert errors == []
    assert config is not None
    assert getattr(config, field) is None


@pytest.mark.parametrize("field", ["authFile", "dataDir", "outputDir", "codeDir", "gpuType"])
def test_optional_fields_may_be_omitted_or_null(field: str) -> None:
    for cfg in (delete(field), mutate(field, None)):
        config, errors = check_job(cfg)
        assert errors == []
        assert config is not None and getattr(config, field) is None


def test_empty_virtual_cluster_means_default() -> None:
    config, errors = check_job(mutate("virtualCluster", ""))
    assert errors == []
    assert config is not None and config.virtualCluster == "default"
    config, _ = check_job(delete("virtualCluster"))
    assert config is not None and config.virtualCluster == "default"


@pytest.mark.parametrize("field", ["minSucceededTaskCount", "minFailedTaskCount", "shmMB"])
def test_null_role_extension_is_accepted(field: str) -> None:
    config, errors = check_job(mutate(f"taskRoles[1].{field}", None))
    assert errors == []
    assert config is not None and getattr(config.taskRoles[1], field) is None


@pytest.mark.parametrize("retry", [-2, -1, 0, 1000])
def test_retry_count_special_values_accepted(retry: int) -> None:
    config, errors = check_job(mutate("retryCount", retry))
    assert errors == []
    assert config is not None and config.retryCount == retry


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("killAllOnCompletedTaskNumber", 0),
        ("killAllOnCompletedTaskNumber", 3),  # = total tasks
        ("killAllOnCompletedTaskNumber", None),
        ("taskRoles[1].minSucceededTaskCount", 2),  # = taskNumber
        ("taskRoles[1].minFailedTaskCount", 2),
        ("taskRoles[1].shmMB", 4096),  # = memoryMB
        ("taskRoles[1].portList[0]", {"label": "ssh", "beginAt": 65535, "portNumber": 1}),
        ("taskRoles[1].portList[0]", {"label": "_x", "beginAt": 65436, "portNumber": 100}),
        ("taskRoles[0].memoryMB", 100),
        ("taskRoles[0].gpuNumber", 0),
        ("taskRoles[0].gpuNumber", 64),
        ("taskRoles[0].gpuNumber", 0.01),  # part of one GPU, in hundredths
        ("taskRoles[0].gpuNumber", 0.99),
        ("taskRoles[0].gpuNumber", 2.0),  # a whole number written as a float is that number
        ("taskRoles[0].name", "_private"),
        ("jobName", "J" * 64),
        ("jobName", "0-job_A"),
        ("image", "registry.example.com:5000/team/img_name:v1.2-rc"),
        ("image", "ubuntu@sha256:" + "a" * 64),
        ("gpuType", "gtx1080-ti.v2"),
        ("dataDir", "hdfs://x/..data/a..b/."),  # '..' inside a segment is fine
        ("jobEnvs", {"_A": "", "B1": 0, "C": -1.5, "D": True}),
        ("extras", {"com.microsoft.pai.runtimeplugin": [{"plugin": "ssh"}], "n": None}),
        ("taskRoles[1].portList", []),
    ],
)
def test_boundary_values_accepted(path: str, value: Any) -> None:
    config, errors = check_job(mutate(path, value))
    assert errors == [], [str(e) for e in errors]
    assert config is not None


def test_a_part_of_a_gpu_is_kept_as_given_and_counted_in_thousandths() -> None:
    config, errors = check_job(mutate("taskRoles[0].gpuNumber", 0.25))
    assert errors == [] and config is not None
    role = config.taskRoles[0]
    assert (role.gpuNumber, role.shares_gpu, role.gpu_devices, role.gpu_milli) == (0.25, True, 1, 250)
    assert '"gpuNumber":0.25' in config.model_dump_json()
    config, _ = check_job(mutate("taskRoles[0].gpuNumber", 2.0))
    assert config is not None
    whole = config.taskRoles[0]
    assert (whole.gpuNumber, type(whole.gpuNumber), whole.shares_gpu, whole.gpu_devices) == (2, int, False, 2)
    assert '"gpuNumber":2,' in config.model_dump_json()


def test_config_is_frozen() -> None:
    config, _ = check_job(copy.deepcopy(BASE))
    assert config is not None
    with pytest.raises(ValidationError):
        config.jobName = "other"  # type: ignore[misc]


def test_corpus_has_29_configs() -> None:
    assert CORPUS.is_dir(), CORPUS
    assert len(CORPUS_FILES) == 29


def test_corpus_has_four_non_strict_json_configs() -> None:
    non_strict = []
    for p in CORPUS_FILES:
        try:
            json.loads(p.read_text())
        except json.JSONDecodeError:
            non_strict.append(p.name)
    assert len(non_strict) == 4, non_strict


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_conformance_config_accepted(path: Path) -> None:
    data = loads(path.read_bytes(), path.name)
    config, errors = check_job(data)
    assert errors == [], [str(e) for e in errors]
    assert isinstance(config, JobConfig)
    assert config.jobName == data["jobName"]
    assert len(config.taskRoles) == len(data["taskRoles"])
    # What the platform stores re-validates to the same config.
    again, errors = check_job(json.loads(config.model_dump_json()))
    assert errors == []
    assert again == config
