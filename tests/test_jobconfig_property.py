"""Property tests: `check_job` never raises and always gives one clear verdict; `loads` raises
nothing but `ConfigSyntaxError`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muster.shared.jobconfig import FieldError, JobConfig, check_job
from muster.shared.loader import ConfigSyntaxError, loads

CORPUS = Path(__file__).resolve().parent / "data" / "openpai-v1"  # copied from OpenPAI: see its README

BASE: dict[str, Any] = {
    "jobName": "prop-job",
    "image": "openpai/pytorch:1.4",
    "dataDir": "hdfs://data",
    "taskRoles": [
        {
            "name": "worker",
            "taskNumber": 2,
            "cpuNumber": 2,
            "memoryMB": 1024,
            "gpuNumber": 0,
            "command": "python train.py",
            "shmMB": 512,
            "minSucceededTaskCount": 1,
            "portList": [{"label": "http", "beginAt": 0, "portNumber": 2}],
        }
    ],
    "killAllOnCompletedTaskNumber": 2,
    "retryCount": -1,
    "jobEnvs": {"EPOCHS": 3, "LR": "0.1"},
    "extras": {"k": [1, {"x": None}]},
}

SEEDS: list[dict[str, Any]] = [BASE] + [loads(p.read_bytes(), p.name) for p in sorted(CORPUS.glob("*.json"))]

TOP_FIELDS = list(JobConfig.model_fields)
ROLE_FIELDS = [
    "name",
    "taskNumber",
    "cpuNumber",
    "memoryMB",
    "gpuNumber",
    "command",
    "shmMB",
    "minFailedTaskCount",
    "minSucceededTaskCount",
    "portList",
    "image",
]
PORT_FIELDS = ["label", "beginAt", "portNumber"]
KEYS = st.sampled_from(TOP_FIELDS + ROLE_FIELDS + PORT_FIELDS) | st.text(max_size=8)

# Integers near the contract's bounds are the interesting ones.
INTS = (
    st.integers(min_value=-5, max_value=200)
    | st.sampled_from([-3, -2, -1, 0, 1, 99, 100, 1024, 4096, 65535, 65536, 10_000, 10_001, 2**63])
    | st.integers()
)
NAMES = st.sampled_from(["w", "ps_server", "a-b", "1x", "", " ", "PAI_X", "x" * 65, "a/b", ".."])


def scalars(finite: bool) -> st.SearchStrategy[Any]:
    return (
        st.none()
        | st.booleans()
        | INTS
        | st.floats(allow_nan=not finite, allow_infinity=not finite)
        | st.text(max_size=12)
        | NAMES
    )


def json_values(finite: bool) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars(finite),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
        max_leaves=12,
    )


ANY_JSON = json_values(finite=False)
FINITE_JSON = json_values(finite=True)
SCALAR = scalars(finite=True)
JUNK = SCALAR | st.lists(SCALAR, max_size=2) | st.dictionaries(KEYS, SCALAR, max_size=2)
PATHS = st.sampled_from(["", "hdfs://x/y", "$PAI_DEFAULT_FS_URI/a", "a..b/c"])
BAD_PATHS = st.sampled_from(["../x", "a/../b", "a\x00b", "x" * 4097])


def mostly(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` four times in five, else `junk` (one_of alone would favour junk's many branches)."""
    return st.sampled_from([True, True, True, True, False]).flatmap(lambda ok: valid if ok else junk)


SMALL = st.integers(1, 4)
GOOD_NAMES = st.sampled_from(["w", "ps_server", "_x", "Worker2"])

# Config-shaped values: each field gets plausible values and sometimes junk, so some pass.
PORT = st.fixed_dictionaries(
    {
        "label": mostly(st.sampled_from(["http", "ssh", "SSH_2"]), NAMES | JUNK),
        "beginAt": mostly(st.sampled_from([0, 8080, 65535, "0", "8080"]), INTS | JUNK | st.just("x1")),
        "portNumber": mostly(SMALL, INTS | JUNK),
    },
)
ROLE = st.fixed_dictionaries(
    {
        "name": mostly(GOOD_NAMES, NAMES | JUNK),
        "taskNumber": mostly(SMALL, INTS | JUNK),
        "cpuNumber": mostly(SMALL, INTS | JUNK),
        "memoryMB": mostly(st.sampled_from([100, 1024, 4096]), INTS | JUNK),
        "gpuNumber": mostly(st.integers(0, 2), INTS | JUNK),
        "command": mostly(
            st.sampled_from(["sleep 1", "python x.py"]), st.sampled_from(["", " \n", "a\x00"]) | JUNK
        ),
    },
    optional={
        "shmMB": mostly(st.sampled_from([64, 100]), INTS | JUNK),
        "minFailedTaskCount": mostly(st.just(1) | st.none(), INTS | JUNK),
        "minSucceededTaskCount": mostly(st.just(1) | st.none(), INTS | JUNK),
        "portList": mostly(st.lists(PORT, max_size=2, unique_by=lambda p: repr(p["label"])), JUNK),
        "image": mostly(st.sampled_from(["ubuntu", "reg:5000/a/b:1"]), st.sampled_from(["Bad", ""]) | JUNK),
    },
)
CONFIG_SHAPED = st.fixed_dictionaries(
    {
        "jobName": mostly(GOOD_NAMES, NAMES | JUNK),
        "image": mostly(
            st.sampled_from(["ubuntu", "openpai/x:1.0"]), st.sampled_from(["Bad Image", "", "a@b"]) | JUNK
        ),
        "taskRoles": mostly(
            st.lists(ROLE, min_size=1, max_size=3, unique_by=lambda r: repr(r["name"])),
            st.lists(ROLE, max_size=3) | JUNK,
        ),
    },
    optional={
        "authFile": mostly(PATHS, BAD_PATHS | JUNK),
        "dataDir": mostly(PATHS, BAD_PATHS | JUNK),
        "outputDir": mostly(PATHS, BAD_PATHS | JUNK),
        "codeDir": mostly(PATHS, BAD_PATHS | JUNK),
        "gpuType": mostly(st.sampled_from(["", "V100"]), st.just("a b") | JUNK),
        "killAllOnCompletedTaskNumber": mostly(st.integers(0, 2) | st.none(), INTS | JUNK),
        "retryCount": mostly(st.integers(-2, 3), INTS | JUNK),
        "virtualCluster": mostly(st.sampled_from(["", "default", "vc1"]), NAMES | JUNK),
        "jobEnvs": mostly(
            st.dictionaries(GOOD_NAMES, SCALAR, max_size=3),
            st.dictionaries(NAMES | KEYS, SCALAR | JUNK, max_size=3) | JUNK,
        ),
        "extras": mostly(st.dictionaries(st.text(max_size=5), FINITE_JSON, max_size=3), JUNK),
        "data": mostly(
            st.lists(st.sampled_from(["ds:/data", "ds2:/x:rw", "ds:/y:ro"]), max_size=3),
            st.lists(st.sampled_from(["ds:/data", "ds", "ds:/a/../b", "ds:/", ":/x", "ds:rel"]) | JUNK)
            | JUNK,
        ),
        "codeSync": mostly(
            st.fixed_dictionaries(
                {"git": st.sampled_from(["https://h/r.git", "/srv/repo", "git@h:r.git"])},
                optional={"branch": st.sampled_from(["main", "v1/x"]), "commit": st.just("abcdef0")},
            ),
            st.fixed_dictionaries({"git": st.sampled_from(["-x", "ext::sh", "ftp://x", "rel"]) | JUNK})
            | JUNK,
        ),
    },
)


def assert_one_verdict(data: Any, *, json_roundtrip: bool = True) -> None:
    before = copy.deepcopy(data)
    result = check_job(data)
    assert isinstance(result, tuple) and len(result) == 2
    config, errors = result
    assert isinstance(errors, list)
    event("accepted" if config is not None else "rejected")
    if config is None:
        assert errors, "rejected without a reason"
        for err in errors:
            assert isinstance(err, FieldError)
            assert isinstance(err.path, str)
            assert isinstance(err.reason, str) and err.reason.strip()
            assert str(err) == (f"{err.path}: {err.reason}" if err.path else err.reason)
        assert len({(e.path, e.reason) for e in errors}) == len(errors), "duplicate errors"
    else:
        assert errors == []
        assert isinstance(config, JobConfig)
        again, errs = check_job(config.model_dump())
        assert errs == [], [str(e) for e in errs]
        assert again == config
        if json_roundtrip:
            stored, errs = check_job(json.loads(config.model_dump_json()))
            assert errs == [], [str(e) for e in errs]
            assert stored == config
    if json_roundtrip:
        assert data == before, "check_job must not modify its input"


PROFILE = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


# (a) arbitrary JSON values -------------------------------------------------------------------


@PROFILE
@given(ANY_JSON)
def test_arbitrary_json_gets_one_verdict(data: Any) -> None:
    assert_one_verdict(data, json_roundtrip=False)


@PROFILE
@given(CONFIG_SHAPED)
def test_config_shaped_json_gets_one_verdict(data: dict[str, Any]) -> None:
    assert_one_verdict(data)


# (b) mutated valid configs -------------------------------------------------------------------


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def _mutate_once(data: st.DataObject, cfg: dict[str, Any]) -> None:
    paths = _paths(cfg)
    op = data.draw(st.sampled_from(["delete", "replace", "insert", "nudge", "retype"]))
    if op == "insert":
        containers = [p for p in paths if isinstance(_get(cfg, p), dict | list)]
        target = _get(cfg, data.draw(st.sampled_from(containers)))
        value = data.draw(FINITE_JSON)
        if isinstance(target, dict):
            target[data.draw(KEYS)] = value
        else:
            target.insert(data.draw(st.integers(0, len(target))), value)
        return
    inner = [p for p in paths if p]
    if not inner:
        return
    if op == "nudge":
        ints = [p for p in inner if isinstance(_get(cfg, p), int)]
        if ints:
            path = data.draw(st.sampled_from(ints))
            _get(cfg, path[:-1])[path[-1]] = data.draw(mostly(SMALL, INTS))
            return
    path = data.draw(st.sampled_from(inner))
    parent, last = _get(cfg, path[:-1]), path[-1]
    if op == "delete":
        del parent[last]
    elif op == "retype":
        old = parent[last]
        parent[last] = str(old) if not isinstance(old, str) else data.draw(st.sampled_from([old, None, 1]))
    else:
        parent[last] = data.draw(FINITE_JSON)


@PROFILE
@given(st.sampled_from(SEEDS), st.data())
def test_mutated_configs_get_one_verdict(seed: dict[str, Any], data: st.DataObject) -> None:
    cfg = copy.deepcopy(seed)
    for _ in range(data.draw(st.integers(1, 4))):
        _mutate_once(data, cfg)
    assert_one_verdict(cfg)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SEEDS))
def test_seeds_are_accepted_and_round_trip(seed: dict[str, Any]) -> None:
    config, errors = check_job(copy.deepcopy(seed))
    assert errors == [] and config is not None
    assert_one_verdict(copy.deepcopy(seed))


# (c) loads -----------------------------------------------------------------------------------

FILENAMES = st.sampled_from(["", "job.json", "job.yaml", "job.yml", "job.txt"])
JSONISH = st.text(alphabet="{}[],:\"/*\\ \n\t0123456789.-eaxtrufnl#!&|>'", max_size=80)
# Deep nesting and long digit runs hit limits of the parsers (recursion, int conversion).
EXTREME = st.builds(
    lambda unit, n, tail: unit * n + tail,
    st.sampled_from(["[", '{"a":', "- ", "a:\n ", "9", "/*", '"\\']),
    st.integers(0, 6000),
    st.sampled_from(["", "]", "}", "1"]),
)


@PROFILE
@given(st.text(max_size=200) | JSONISH | st.binary(max_size=200) | EXTREME, FILENAMES)
def test_loads_returns_or_raises_config_syntax_error(text: str | bytes, filename: str) -> None:
    try:
        loads(text, filename)
    except ConfigSyntaxError as exc:
        assert str(exc)


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(codec="utf-16", exclude_categories=()), max_size=20), FILENAMES)
def test_loads_on_text_with_surrogates(text: str, filename: str) -> None:
    try:
        loads(text, filename)
    except ConfigSyntaxError as exc:
        assert str(exc)


@st.composite
def commented_json(draw: st.DrawFn) -> tuple[Any, str]:
    """A JSON value and its text with `//` / `/* */` comments and trailing commas added."""
    value = draw(FINITE_JSON)
    lines = json.dumps(value, indent=2).split("\n")
    for i in range(1, len(lines)):
        closing = lines[i].strip()[:1] in ("}", "]")
        if closing and lines[i - 1].rstrip()[-1:] not in ("{", "[") and draw(st.booleans()):
            lines[i - 1] += ","
    comment = st.text(max_size=10).filter(lambda t: "\n" not in t and "*/" not in t)
    out = []
    for line in lines:
        if draw(st.booleans()):
            out.append("// " + draw(comment))
        if draw(st.booleans()):
            line += " /* " + draw(comment) + " */"
        elif draw(st.booleans()):
            line += " // " + draw(comment)
        out.append(line)
    return value, "\n".join(out)


@PROFILE
@given(commented_json(), st.sampled_from(["", "job.json"]))
def test_json_with_comments_decodes_to_the_same_value(case: tuple[Any, str], filename: str) -> None:
    value, text = case
    assert loads(text, filename) == value
    assert loads(text.encode(), filename) == value
