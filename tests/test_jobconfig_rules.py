"""The cross-field rules (shared/jobconfig.py's JOB_RULES, ROLE_RULES, PORT_RULES): every rule's
error, its field and its place in the order they are reported, pinned on one config that breaks
them all (the order users and the validator's verdicts see)."""

from __future__ import annotations

from typing import Any

import pytest

from muster.shared.jobconfig import _cross_field_errors, check_job

ROLES: list[Any] = [
    {
        "name": "a",
        "taskNumber": 2,
        "minFailedTaskCount": 3,
        "minSucceededTaskCount": 4,
        "shmMB": 900,
        "memoryMB": 512,
        "portList": [
            {"label": "p", "beginAt": 65530, "portNumber": 10},
            {"label": "p", "beginAt": "65535", "portNumber": 2},
        ],
    },
    {"name": "a", "taskNumber": 2, "minTaskNumber": 3, "maxTaskNumber": 1, "minFailedTaskCount": 1},
    {"name": "b", "taskNumber": 1, "maxTaskNumber": 4},
]
BROKEN: dict[str, Any] = {
    "extras": {"elastic": {"signal": "SIGKILL"}, "mpi": {"launcher": "nope"}},
    "taskRoles": ROLES,
    "data": ["one:/mnt/x", "two:/mnt/x/"],
    "codeSync": {"git": "https://example.com/y.git", "branch": "main", "commit": "abc"},
    "killAllOnCompletedTaskNumber": 99,
    "jobEnvs": {"MUSTER_X": "1", "OK": "2"},
}
EXPECTED = [
    ("extras.elastic.signal", "must be one of SIGHUP, SIGUSR1, SIGUSR2, got 'SIGKILL'"),
    ("extras.mpi.launcher", "must name a task role (a, a, b), got 'nope'"),
    ("taskRoles[0].minFailedTaskCount", "must be ≤ taskNumber (2), got 3"),
    ("taskRoles[0].minSucceededTaskCount", "must be ≤ taskNumber (2), got 4"),
    ("taskRoles[0].shmMB", "must be ≤ memoryMB (512), got 900"),
    ("taskRoles[0].portList[0].portNumber", "ports 65530..65539 run past 65535"),
    ("taskRoles[0].portList[1].label", "duplicate port label 'p'"),
    ("taskRoles[0].portList[1].portNumber", "ports 65535..65536 run past 65535"),
    ("taskRoles[1].name", "duplicate role name 'a' (also taskRoles[0])"),
    ("taskRoles[1].minTaskNumber", "must be ≤ taskNumber (2), got 3"),
    ("taskRoles[1].maxTaskNumber", "must be ≥ taskNumber (2), got 1"),
    (
        "taskRoles[1].minFailedTaskCount",
        "does not apply to an elastic role: it fails when fewer than minTaskNumber tasks are left",
    ),
    ("taskRoles[2].minTaskNumber", "required with maxTaskNumber (an elastic role gives both)"),
    ("data[1]", "/mnt/x is already mounted by data[0]"),
    ("codeSync.commit", "give a branch or a commit, not both"),
    ("killAllOnCompletedTaskNumber", "must be ≤ the job's total tasks (8), got 99"),
    ("jobEnvs.MUSTER_X", "names starting with MUSTER_ are set by the platform"),
]


def test_every_rule_reports_its_field_and_reason_in_order() -> None:
    assert [(e.path, e.reason) for e in _cross_field_errors(BROKEN)] == EXPECTED
    _, errors = check_job(BROKEN)  # and the verdict carries them in that order
    found = [(e.path, e.reason) for e in errors]
    assert [f for f in found if f in EXPECTED] == EXPECTED


NO_ROLE_NAMED = ("extras.mpi.launcher", "must name a task role (), got 'nope'")


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        # Not a list: only the rules that need no roles run (taskRoles' own error says the rest).
        ("not a list", [EXPECTED[0], NO_ROLE_NAMED]),
        # A role that is not an object is skipped by the role rules (the next keeps its index)
        # and makes the job's total unknown: no killAllOnCompletedTaskNumber bound.
        (
            ["x", *ROLES[1:]],
            [
                EXPECTED[0],
                ("extras.mpi.launcher", "must name a task role (a, b), got 'nope'"),
                *EXPECTED[9:15],
                *EXPECTED[16:],
            ],
        ),
        # No roles: the total is unknown too.
        ([], [EXPECTED[0], NO_ROLE_NAMED, *EXPECTED[13:15], EXPECTED[16]]),
    ],
)
def test_rules_that_need_the_roles(roles: Any, expected: list[tuple[str, str]]) -> None:
    got = [(e.path, e.reason) for e in _cross_field_errors({**BROKEN, "taskRoles": roles})]
    assert got == expected
