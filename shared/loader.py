"""Decoding job config text as people write it: JSON, JSON with `//` comments or trailing commas
(as in OpenPAI's own examples), or YAML. Raises `ConfigSyntaxError` with a line number."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

MAX_CONFIG_BYTES = 1024 * 1024


class ConfigSyntaxError(ValueError):
    pass


# An unterminated string or block comment runs to the end of the text: without the `\Z` the
# regex would rescan the rest of the text from every later quote or `/*` (quadratic: minutes
# for 1 MiB).
_STRING = r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)'
_COMMENT = re.compile(_STRING + r"|//[^\n]*|/\*.*?(?:\*/|\Z)", re.S)
# A second pass, so that a trailing comma followed by a comment (`1, // note` then `}`) goes too.
_TRAILING_COMMA = re.compile(_STRING + r"|,(?=\s*[}\]])", re.S)


def strip_json_comments(text: str) -> str:
    """Drop `//` and `/* */` comments and trailing commas outside strings; keeps line numbers."""

    def keep(m: re.Match[str]) -> str:
        tok = m.group(0)
        if tok.startswith('"'):
            return tok
        return "\n" * tok.count("\n")

    return _TRAILING_COMMA.sub(keep, _COMMENT.sub(keep, text))


def loads(text: str | bytes, filename: str = "") -> Any:
    try:
        return _loads(text, filename)
    except ConfigSyntaxError:
        raise
    except RecursionError:
        raise ConfigSyntaxError("config is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer longer than Python's 4300-digit limit
        raise ConfigSyntaxError(f"invalid config: {exc}") from None


def _loads(text: str | bytes, filename: str) -> Any:
    if isinstance(text, bytes):
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigSyntaxError(
                f"config is {len(text)} bytes; the limit is {MAX_CONFIG_BYTES} bytes (1 MiB)"
            )
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigSyntaxError(f"config is not UTF-8 text: {exc}") from None
    else:
        try:
            size = len(text.encode())
        except UnicodeEncodeError as exc:  # lone surrogates
            raise ConfigSyntaxError(f"config is not valid Unicode text: {exc}") from None
        if size > MAX_CONFIG_BYTES:
            raise ConfigSyntaxError(f"config is larger than {MAX_CONFIG_BYTES} bytes (1 MiB)")
    if filename.endswith((".yaml", ".yml")):
        return _yaml(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(strip_json_comments(text))
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith(("{", "[")):
            raise ConfigSyntaxError(
                f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
    return _yaml(text)


def _yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigSyntaxError(f"invalid YAML{where}: {problem}") from None
