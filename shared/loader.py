"""Decoding job config text as people write it: JSON, JSON with `//` comments or trailing commas
(as in OpenPAI's own examples), or YAML. Raises `ConfigSyntaxError` with a line number.

What a config may expand to is bounded, since the text comes from anyone who can submit: at
most MAX_CONFIG_BYTES of text, at most MAX_YAML_ALIASES YAML aliases, no recursive alias, and
no YAML document whose aliases (and merge keys) would expand it past MAX_CONFIG_BYTES, measured
while PyYAML composes the nodes, before anything is expanded. A key written twice in one
object or mapping is an error, naming the key and where it is.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from muster.shared.configlimits import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from muster.shared.configlimits import MAX_YAML_ALIASES as MAX_YAML_ALIASES


class ConfigSyntaxError(ValueError):
    pass


LOCAL_DIR_FIELDS = ("dataDir", "codeDir", "outputDir", "authFile")


def absolutize(raw: Any, base: str) -> bool:
    """Dir fields written relative to the config file (`./code`) become absolute paths under
    `base` (the config's directory: `muster submit`; the directory a person names: the portal),
    so a config next to its code works from anywhere. Returns whether any did."""
    if not isinstance(raw, dict):
        return False
    changed = False
    for key in LOCAL_DIR_FIELDS:
        value = raw.get(key)
        if isinstance(value, str) and (value == "." or value.startswith("./")):
            raw[key] = os.path.normpath(os.path.join(base, value))
            changed = True
    return changed


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
        return _json(text)
    except json.JSONDecodeError:
        pass
    try:
        return _json(strip_json_comments(text))
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith(("{", "[")):
            raise ConfigSyntaxError(
                f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
    return _yaml(text)


def _json(text: str) -> Any:
    """`json.loads`, refusing a key written twice in one object (named with the object's path)."""
    twice: list[tuple[dict[str, Any], str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(items)
        if len(obj) < len(items) and not twice:
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    twice.append((obj, key))
                    break
                seen.add(key)
        return obj

    value = json.loads(text, object_pairs_hook=pairs)
    if twice:
        obj, key = twice[0]
        where = _path_of(value, obj)
        raise ConfigSyntaxError(f"invalid JSON: duplicate key {key!r}" + (f" in {where}" if where else ""))
    return value


def _path_of(root: Any, target: Any) -> str:
    """Where `target` sits inside `root`, as users write it (`taskRoles[1]`); iterative, so any
    depth json.loads accepts is fine."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        value, path = stack.pop()
        if value is target:
            return path
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return ""


def _yaml(text: str) -> Any:
    # Not a circle (shared/yamlload.py imports only shared/configlimits.py): PyYAML is loaded only
    # for YAML, a JSON submit skips it.
    from muster.shared.yamlload import ConfigYAMLError, load

    try:
        return load(text)
    except ConfigYAMLError as exc:
        raise ConfigSyntaxError(str(exc)) from None
