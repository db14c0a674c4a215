"""shared/hostpaths.py: which host paths a job's dir fields may name (issue 8, safe inputs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from muster.shared.hostpaths import (
    RootsError,
    check_dirs,
    lexical_problem,
    parse_roots,
    resolve_under_roots,
    roots_for,
)
from muster.shared.jobconfig import check_job

# ---------------------------------------------------------------- parse_roots


def test_roots_are_absolute_normalised_and_may_hold_the_user():
    assert parse_roots(" /data/{user} , /srv/shared/ ,, /a//b/./c") == [
        "/data/{user}",
        "/srv/shared",
        "/a/b/c",
    ]
    assert parse_roots("") == []


@pytest.mark.parametrize(
    "text, named",
    [
        ("/data,relative/dir", "relative/dir"),
        ("/data,/", "'/'"),
        ("//", "'/'"),
        ("/data/../etc", "/data/../etc"),
    ],
)
def test_a_bad_root_is_refused_by_name(text, named):
    with pytest.raises(RootsError) as refused:
        parse_roots(text)
    assert named in str(refused.value)


def test_slash_as_a_root_says_why():
    with pytest.raises(RootsError, match="whole host"):
        parse_roots("/")


# ---------------------------------------------------------------- roots_for


def test_each_user_gets_their_own_root():
    roots = ["/data/users/{user}", "/srv/shared"]
    assert roots_for(roots, "alice") == ["/data/users/alice", "/srv/shared"]


@pytest.mark.parametrize("user", ["", ".", "..", "a/b", "../bob"])
def test_a_user_name_that_could_step_out_gets_no_user_root(user):
    assert roots_for(["/data/users/{user}", "/srv/shared"], user) == ["/srv/shared"]


# ---------------------------------------------------------------- lexical_problem

ROOTS = ["/data/users/alice", "/srv/shared"]


@pytest.mark.parametrize(
    "path",
    ["/data/users/alice", "/data/users/alice/code", "file:///srv/shared/x", "hdfs://nn:9000/x", "s3://b/k"],
)
def test_paths_under_a_root_and_non_host_uris_pass(path):
    assert lexical_problem(path, ROOTS) is None


@pytest.mark.parametrize(
    "path, why",
    [
        ("/", "not under the allowed roots"),
        ("/etc", "not under the allowed roots"),
        ("/var/run/docker.sock", "not under the allowed roots"),
        ("/data/users/alicex", "not under the allowed roots"),  # a prefix is not a parent
        ("/data/users/bob", "not under the allowed roots"),
        ("/data/users/alice/../bob", "'..'"),
        ("/data/users/alice/..", "'..'"),
        ("data/users/alice", "absolute"),
        ("./code", "absolute"),
        ("file:///etc", "not under the allowed roots"),
    ],
)
def test_paths_outside_the_roots_are_refused(path, why):
    problem = lexical_problem(path, ROOTS)
    assert problem is not None and why in problem, problem


def test_no_roots_allows_no_host_path():
    problem = lexical_problem("/data/x", [])
    assert problem is not None and "none configured" in problem


# ---------------------------------------------------------------- resolve_under_roots


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "root" / "code").mkdir(parents=True)
    (tmp_path / "root" / "data").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path


def test_a_path_under_a_root_resolves_to_itself(tree):
    root = str(tree / "root")
    assert resolve_under_roots(f"{root}/code", [root]) == f"{root}/code"
    assert resolve_under_roots(root, [root]) == root  # a root itself may be mounted
    assert resolve_under_roots(f"file://{root}/data", [root]) == f"{root}/data"


def test_a_link_within_the_roots_resolves_to_its_target(tree):
    root = str(tree / "root")
    os.symlink(f"{root}/data", f"{root}/link")
    assert resolve_under_roots(f"{root}/link", [root]) == f"{root}/data"


@pytest.mark.parametrize("target", ["/", "/etc", "/var/run/docker.sock", "{tmp}/outside"])
def test_a_link_out_of_a_root_is_refused(tree, target):
    root = str(tree / "root")
    os.symlink(target.replace("{tmp}", str(tree)), f"{root}/escape")
    with pytest.raises(ValueError, match="outside the allowed roots"):
        resolve_under_roots(f"{root}/escape", [root])
    with pytest.raises(ValueError, match="outside the allowed roots"):
        resolve_under_roots(f"{root}/escape/sub", [root])


def test_a_root_that_is_itself_a_link_allows_nothing(tree):
    # A user owning /data/users/alice could make it a link to /etc.
    os.symlink("/etc", tree / "alice")
    with pytest.raises(ValueError, match="outside the allowed roots"):
        resolve_under_roots(f"{tree}/alice/passwd", [str(tree / "alice")])


def test_links_above_a_root_are_followed(tree):
    os.symlink(tree / "root", tree / "mnt")
    assert resolve_under_roots(f"{tree}/mnt/code", [f"{tree}/mnt/code"]) == f"{tree}/root/code"


@pytest.mark.parametrize("path", ["relative", "hdfs://nn/x", "{root}/../outside"])
def test_resolving_refuses_what_is_no_absolute_path_under_a_root(tree, path):
    root = str(tree / "root")
    with pytest.raises(ValueError):
        resolve_under_roots(path.replace("{root}", root), [root])


# ---------------------------------------------------------------- check_dirs


def config(**fields):
    cfg, errors = check_job(
        {
            "jobName": "job1",
            "image": "img",
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 256,
                    "gpuNumber": 0,
                    "command": "true",
                }
            ],
            **fields,
        }
    )
    assert cfg is not None, errors
    return cfg


def test_check_dirs_names_each_field_outside_the_roots():
    cfg = config(dataDir="/etc", codeDir="/data/alice/code", outputDir="/", authFile="/root/.docker/auth")
    errors = check_dirs(cfg, "alice", ["/data/{user}"])
    assert [e.path for e in errors] == ["dataDir", "outputDir", "authFile"]
    assert all("not under the allowed roots" in e.reason for e in errors)


def test_check_dirs_expands_the_user_and_job_name_as_the_agent_does():
    cfg = config(codeDir="/data/$PAI_USERNAME/${PAI_JOB_NAME}", dataDir="file:///data/$PAI_USERNAME")
    assert check_dirs(cfg, "alice", ["/data/{user}"]) == []
    errors = check_dirs(cfg, "bob", ["/data/alice"])
    assert [e.path for e in errors] == ["dataDir", "codeDir"]


def test_check_dirs_leaves_other_variables_and_uris_for_launch():
    cfg = config(dataDir="$PAI_DEFAULT_FS_URI/data", codeDir="hdfs://nn/code", outputDir="$HOME/out")
    assert check_dirs(cfg, "alice", ["/data/{user}"]) == []


def test_check_dirs_refuses_other_users_roots():
    cfg = config(codeDir="/data/bob/code", outputDir="//data/alice/out")
    errors = check_dirs(cfg, "alice", ["/data/{user}"])
    assert [e.path for e in errors] == ["codeDir"]
    assert "/data/alice" in errors[0].reason  # says which roots are allowed


def test_a_dot_dot_is_refused_by_the_config_check_itself():
    _, errors = check_job(
        {
            "jobName": "job1",
            "image": "img",
            "outputDir": "/data/alice/../bob",
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 256,
                    "gpuNumber": 0,
                    "command": "true",
                }
            ],
        }
    )
    assert [e.path for e in errors] == ["outputDir"]
