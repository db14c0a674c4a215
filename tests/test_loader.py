"""Decoding job config text: strict JSON, JSON with comments / trailing commas, YAML."""

from __future__ import annotations

from typing import Any

import pytest

from shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, loads, strip_json_comments

OK_CASES = [
    pytest.param('{"jobName": "a", "n": 1}', "job.json", {"jobName": "a", "n": 1},
                 id="strict-json"),
    pytest.param(b'{"jobName": "a"}', "job.json", {"jobName": "a"}, id="strict-json-bytes"),
    pytest.param(b'\xef\xbb\xbf{"a": 1}', "", {"a": 1}, id="utf8-bom"),
    pytest.param('{"a": "caf\u00e9 \u2265"}'.encode(), "", {"a": "caf\u00e9 \u2265"},
                 id="utf8-bytes"),
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
    pytest.param(
        '{\n  "a": 1, // last field\n}', "", {"a": 1}, id="trailing-comma-then-comment"
    ),
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
    pytest.param("jobName: a\nretryCount: -1\n", "job.yml", {"jobName": "a", "retryCount": -1},
                 id="yml-file"),
    pytest.param(
        "# a YAML config\njobName: x\nimage: 'ubuntu:22.04'\n",
        "",
        {"jobName": "x", "image": "ubuntu:22.04"},
        id="yaml-content-no-extension",
    ),
    pytest.param("jobName: x\n", "job.txt", {"jobName": "x"}, id="yaml-content-other-extension"),
    pytest.param('{"a": "http://x"}', "job.yaml", {"a": "http://x"}, id="json-in-yaml-file"),
    pytest.param("[1, 2]", "", [1, 2], id="json-list"),
    pytest.param("", "", None, id="empty-text"),
]


@pytest.mark.parametrize(("text", "filename", "expected"), OK_CASES)
def test_loads_decodes(text: str | bytes, filename: str, expected: Any) -> None:
    assert loads(text, filename) == expected


ERROR_CASES = [
    pytest.param('{\n  "a": 1,\n  "b" 2\n}', "job.json", "line 3", id="json-missing-colon"),
    pytest.param('{\n  // c\n  "a": 1\n  "b": 2\n}', "", "line 4", id="json-with-comments"),
    pytest.param('{\n  /* two\n  lines */ "a": 1\n  "b": 2\n}', "", "line 4",
                 id="json-block-comment-keeps-lines"),
    pytest.param("[1, 2", "", "line 1", id="json-unclosed-list"),
    pytest.param('{"a": "unterminated}', "", "invalid JSON", id="json-unterminated-string"),
    pytest.param('{"a": 1, /* unterminated', "", "invalid JSON", id="json-unterminated-comment"),
    pytest.param("a: 1\nb: [1, 2\nc: 3\n", "job.yaml", "line 3", id="yaml-unclosed-flow"),
    pytest.param("a: 1\n  b: 2\n", "job.yml", "line 2", id="yaml-bad-indent"),
    pytest.param("a: 1\n\tb: 2\n", "", "invalid YAML", id="yaml-tab"),
    pytest.param("a: !!python/object/apply:os.system ['true']\n", "job.yaml", "invalid YAML",
                 id="yaml-python-tag-refused"),
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
