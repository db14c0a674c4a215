"""Decoding job config text: strict JSON, JSON with comments / trailing commas, YAML."""

from __future__ import annotations

from typing import Any

import pytest

from muster.shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, loads, strip_json_comments

OK_CASES = [
    pytest.param('{"jobName": "a", "n": 1}', "job.json", {"jobName": "a", "n": 1}, id="strict-json"),
    pytest.param(b'{"jobName": "a"}', "job.json", {"jobName": "a"}, id="strict-json-bytes"),
    pytest.param(b'\xef\xbb\xbf{"a": 1}', "", {"a": 1}, id="utf8-bom"),
    pytest.param('{"a": "caf\u00e9 \u2265"}'.encode(), "", {"a": "caf\u00e9 \u2265"}, id="utf8-bytes"),
    pytest.param(
        '{\n  // a comment line\n  "a": 1,\n    // indented comment\n  "b": 2\n}',
        "job.json",
        {"a": 1, "b": 2},
        id="line-comments",
    ),
    pytest.param('{"a": 1 // trailing comment\n}', "", {"a": 1}, id="end-of-line-comment"),
    pytest.param(
        '{\n  /* block\n     comment */ "a": 1, /* inline */ "b": [1, /* x */ 2]\n}',
        "job.json",
        {"a": 1, "b": [1, 2]},
        id="block-comments",
    ),
    pytest.param('{"a": 1, "b": 2,}', "job.json", {"a": 1, "b": 2}, id="trailing-comma-object"),
    pytest.param('{"a": [1, 2, ],\n}', "job.json", {"a": [1, 2]}, id="trailing-comma-list"),
    pytest.param('{\n  "a": 1,\n  \t\n}', "", {"a": 1}, id="trailing-comma-then-whitespace"),
    pytest.param('{\n  "a": 1, // last field\n}', "", {"a": 1}, id="trailing-comma-then-comment"),
    pytest.param('{"a": [1, /* c */ ]}', "", {"a": [1]}, id="trailing-comma-then-block-comment"),
    pytest.param(
        '{\n  // see below\n  "url": "http://x/y", "glob": "/*.py", "c": "a, }"\n}',
        "job.json",
        {"url": "http://x/y", "glob": "/*.py", "c": "a, }"},
        id="comment-markers-inside-strings-kept",
    ),
    pytest.param(
        '{"q": "say \\"//hi\\"", // note\n "r": "x\\\\"}',
        "",
        {"q": 'say "//hi"', "r": "x\\"},
        id="escaped-quotes-in-strings",
    ),
    pytest.param(
        "jobName: yaml-job\ntaskRoles:\n  - name: worker\n    taskNumber: 2\n",
        "job.yaml",
        {"jobName": "yaml-job", "taskRoles": [{"name": "worker", "taskNumber": 2}]},
        id="yaml-file",
    ),
    pytest.param(
        "jobName: a\nretryCount: -1\n", "job.yml", {"jobName": "a", "retryCount": -1}, id="yml-file"
    ),
    pytest.param(
        "# a YAML config\njobName: x\nimage: 'ubuntu:22.04'\n",
        "",
        {"jobName": "x", "image": "ubuntu:22.04"},
        id="yaml-content-no-extension",
    ),
    pytest.param("jobName: x\n", "job.txt", {"jobName": "x"}, id="yaml-content-other-extension"),
    pytest.param('{"a": "http://x"}', "job.yaml", {"a": "http://x"}, id="json-in-yaml-file"),
    # A date or time stays the text it was written as (PyYAML's date objects have no JSON form).
    pytest.param(
        "jobEnvs:\n  RELEASE: 2024-05-01\n  AT: !!timestamp 2024-05-01T10:00:00Z\n",
        "job.yaml",
        {"jobEnvs": {"RELEASE": "2024-05-01", "AT": "2024-05-01T10:00:00Z"}},
        id="yaml-dates-stay-text",
    ),
    pytest.param("[1, 2]", "", [1, 2], id="json-list"),
    pytest.param("", "", None, id="empty-text"),
]


@pytest.mark.parametrize(("text", "filename", "expected"), OK_CASES)
def test_loads_decodes(text: str | bytes, filename: str, expected: Any) -> None:
    assert loads(text, filename) == expected


ERROR_CASES = [
    pytest.param('{\n  "a": 1,\n  "b" 2\n}', "job.json", "line 3", id="json-missing-colon"),
    pytest.param('{\n  // c\n  "a": 1\n  "b": 2\n}', "", "line 4", id="json-with-comments"),
    pytest.param(
        '{\n  /* two\n  lines */ "a": 1\n  "b": 2\n}', "", "line 4", id="json-block-comment-keeps-lines"
    ),
    pytest.param("[1, 2", "", "line 1", id="json-unclosed-list"),
    pytest.param('{"a": "unterminated}', "", "invalid JSON", id="json-unterminated-string"),
    pytest.param('{"a": 1, /* unterminated', "", "invalid JSON", id="json-unterminated-comment"),
    pytest.param("a: 1\nb: [1, 2\nc: 3\n", "job.yaml", "line 3", id="yaml-unclosed-flow"),
    pytest.param("a: 1\n  b: 2\n", "job.yml", "line 2", id="yaml-bad-indent"),
    pytest.param("a: 1\n\tb: 2\n", "", "invalid YAML", id="yaml-tab"),
    pytest.param(
        "a: !!python/object/apply:os.system ['true']\n",
        "job.yaml",
        "invalid YAML",
        id="yaml-python-tag-refused",
    ),
    pytest.param(
        "extras:\n  blob: !!binary aGVsbG8=\n",
        "job.yaml",
        "extras.blob: binary data has no JSON form",
        id="yaml-binary",
    ),
    pytest.param(
        "extras:\n  s: !!set {a, b}\n", "job.yaml", "extras.s: a set has no JSON form", id="yaml-set"
    ),
    pytest.param(b'{"a": "\xff\xfe"}', "job.json", "not UTF-8", id="non-utf8-bytes"),
    pytest.param(b"\xc3\x28", "", "not UTF-8", id="invalid-utf8-sequence"),
    pytest.param("\ud800", "", "not valid Unicode", id="lone-surrogate-text"),
    pytest.param("[" * 100_000, "", "nested too deeply", id="deep-json"),
    pytest.param("a:\n" + "- " * 5_000 + "x\n", "job.yaml", "", id="deep-yaml"),
    pytest.param('{"n": ' + "9" * 5_000 + "}", "", "4300 digits", id="huge-integer"),
]


@pytest.mark.parametrize(("text", "filename", "message"), ERROR_CASES)
def test_loads_reports_syntax_errors(text: str | bytes, filename: str, message: str) -> None:
    with pytest.raises(ConfigSyntaxError) as info:
        loads(text, filename)
    assert message in str(info.value)


def test_syntax_error_reports_line_and_column() -> None:
    with pytest.raises(ConfigSyntaxError, match=r"^invalid JSON at line 3 column 10: "):
        loads('{\n  "a": 1,\n  "b": 2 3\n}')


def test_config_syntax_error_is_a_value_error() -> None:
    assert issubclass(ConfigSyntaxError, ValueError)


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "text"])
def test_over_one_mib_is_refused(as_bytes: bool) -> None:
    body = '{"a": "' + "x" * MAX_CONFIG_BYTES + '"}'
    with pytest.raises(ConfigSyntaxError, match=str(MAX_CONFIG_BYTES)) as info:
        loads(body.encode() if as_bytes else body, "job.json")
    assert "1 MiB" in str(info.value)


def test_exactly_one_mib_is_accepted() -> None:
    prefix, suffix = '{"a": "', '"}'
    body = prefix + "x" * (MAX_CONFIG_BYTES - len(prefix) - len(suffix)) + suffix
    assert len(body.encode()) == MAX_CONFIG_BYTES
    assert loads(body.encode(), "job.json") == {"a": "x" * (MAX_CONFIG_BYTES - 9)}


def test_limit_counts_utf8_bytes_not_characters() -> None:
    body = '"' + "\u00e9" * (MAX_CONFIG_BYTES // 2) + '"'  # fewer characters than the limit
    assert len(body) < MAX_CONFIG_BYTES < len(body.encode())
    with pytest.raises(ConfigSyntaxError, match="1 MiB"):
        loads(body)


@pytest.mark.parametrize(
    "text",
    [
        "{" + "/* " * 200_000,  # unterminated block comments
        '{"' + '\\"' * 200_000,  # an unterminated string full of escaped quotes
        "{" + '"/*' * 200_000,
    ],
    ids=["unterminated-comments", "escaped-quotes", "quote-comment-mix"],
)
@pytest.mark.timeout(10)
def test_pathological_text_fails_fast(text: str) -> None:
    with pytest.raises(ConfigSyntaxError):
        loads(text)


def test_strip_json_comments_keeps_line_numbers() -> None:
    text = '{\n  // one\n  /* two\n  three */\n  "a": "//x",\n}'
    out = strip_json_comments(text)
    assert out.count("\n") == text.count("\n")
    assert "//x" in out
    assert "one" not in out and "three" not in out
    assert out.rstrip().endswith("\n}")


# ------------------------------------------------------------------ bounded expansion (defect 15)

JOB_HEAD = (
    "jobName: bomb\nimage: python:3.11\n"
    "taskRoles:\n"
    "  - {name: w, taskNumber: 1, cpuNumber: 1, memoryMB: 256, gpuNumber: 0, command: 'true'}\n"
    "extras:\n"
)


def laughs(levels: int, indent: str = "") -> str:
    """Billion laughs: each level is a list of nine aliases to the level below (9**levels strings)."""
    lines = [f"{indent}l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"{indent}l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


# A valid job carrying the bomb in `extras`: before the fix, accepted as a 3.7 MB job record.
SMALL_BOMB = JOB_HEAD + laughs(6, "  ")
# Two more levels: gigabytes once anything (pydantic, json.dumps) walks the decoded structure.
BIG_BOMB = JOB_HEAD + laughs(8, "  ")
# Merge keys expand while PyYAML constructs the mappings: each level merges nine copies
# (six levels: 4 million key/value pairs, seconds and 100 MB before the fix; 8 levels: gigabytes).
MERGE_BOMB = "m0: &m0 {a: lol, b: lol, c: lol, d: lol, e: lol, f: lol, g: lol, h: lol}\n" + "".join(
    f"m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + "]}\n" for i in range(1, 7)
)


def test_bomb_payloads_are_tiny() -> None:
    assert len(SMALL_BOMB) < 500 and len(BIG_BOMB) < 600 and len(MERGE_BOMB) < 500


@pytest.mark.parametrize(
    "text",
    [SMALL_BOMB, BIG_BOMB, laughs(12), MERGE_BOMB, "a: &a [*a]\n"],
    ids=["bomb-6-levels", "bomb-8-levels", "bomb-12-levels", "merge-key-bomb", "recursive-alias"],
)
@pytest.mark.timeout(30)
def test_yaml_alias_bombs_are_refused_without_expanding(text: str) -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ConfigSyntaxError, match=r"^invalid YAML at line \d+ column \d+: ") as info:
            loads(text, "job.yaml")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 1024 * 1024, f"loading took {peak} bytes"
    assert "alias" in str(info.value)


def test_a_few_aliases_within_the_size_limit_still_work() -> None:
    text = (
        "defaults: &d {cpuNumber: 1, memoryMB: 256}\nroles:\n  - {<<: *d, name: a}\n  - {<<: *d, name: b}\n"
    )
    assert loads(text, "job.yaml") == {
        "defaults": {"cpuNumber": 1, "memoryMB": 256},
        "roles": [
            {"cpuNumber": 1, "memoryMB": 256, "name": "a"},
            {"cpuNumber": 1, "memoryMB": 256, "name": "b"},
        ],
    }


def test_more_aliases_than_the_limit_are_refused_even_when_small() -> None:
    from muster.shared.loader import MAX_YAML_ALIASES

    text = "a: &a x\nb: [" + ", ".join(["*a"] * (MAX_YAML_ALIASES + 1)) + "]\n"
    with pytest.raises(ConfigSyntaxError, match=f"more than {MAX_YAML_ALIASES} aliases"):
        loads(text, "job.yaml")
    assert loads(text.replace("*a, ", "", 1), "job.yaml")["b"] == ["x"] * MAX_YAML_ALIASES


@pytest.mark.parametrize(
    ("text", "filename", "message"),
    [
        ('{"jobName": "a", "jobName": "b"}', "job.json", "duplicate key 'jobName'"),
        (
            '{"taskRoles": [{"name": "w"}, {"name": "x", "cpuNumber": 1, "name": "y"}]}',
            "",
            "duplicate key 'name' in taskRoles[1]",
        ),
        ('{\n  // c\n  "a": {"b": 1, "b": 2,},\n}', "", "duplicate key 'b' in a"),
        ("jobName: a\nimage: x\njobName: b\n", "job.yaml", "line 3 column 1: duplicate key 'jobName'"),
        (
            "taskRoles:\n  - name: w\n    cpuNumber: 1\n    'name': v\n",
            "job.yaml",
            "line 4 column 5: duplicate key 'name' in taskRoles[0]",
        ),
        ("{a: 1, a: 2}", "job.yaml", "duplicate key 'a'"),
    ],
    ids=["json-top", "json-nested", "json-with-comments", "yaml-top", "yaml-nested", "yaml-flow"],
)
def test_duplicate_keys_are_refused_with_the_key_and_where(text: str, filename: str, message: str) -> None:
    with pytest.raises(ConfigSyntaxError) as info:
        loads(text, filename)
    assert message in str(info.value)


def test_merge_keys_overridden_by_own_keys_are_not_duplicates() -> None:
    text = "base: &b {a: 1, c: 3}\nx: &x {<<: *b, a: 2}\ny: {<<: *x}\nz: *x\n"
    assert loads(text, "job.yaml")["z"] == {"a": 2, "c": 3}
