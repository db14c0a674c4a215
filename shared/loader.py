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
import re
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.error import Mark

MAX_CONFIG_BYTES = 1024 * 1024
MAX_YAML_ALIASES = 100


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


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with limits checked as each node is composed (PyYAML's own hooks):
    aliases are counted, a node's size once every alias in it is expanded is worked out from
    its children's (about its JSON length), and keys written twice are refused."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0
        self.sizes: dict[int, int] = {}  # id(node) -> expanded size, set once the node is complete
        self.path: list[str] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # types-PyYAML leaves Parser.peek_event unannotated; it returns the next event.
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]
        if parent is not None and index is not None:  # a list item, or a mapping's value
            key = index.value if isinstance(index, yaml.ScalarNode) else "?"
            self.path.append(f"[{index}]" if isinstance(index, int) else f".{key}")
        try:
            node = super().compose_node(parent, index)
            # Composer.compose_node always returns a node; the stubs type it `Node | None`.
            assert node is not None
        finally:
            if parent is not None and index is not None:
                self.path.pop()
        if isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise ComposerError(None, None, f"more than {MAX_YAML_ALIASES} aliases", _mark(event))
            if id(node) not in self.sizes:
                raise ComposerError(
                    None, None, "an alias inside the node it refers to (recursive)", _mark(event)
                )
            return node
        size = _expanded_size(node, self.sizes)
        if size > MAX_CONFIG_BYTES:
            raise ComposerError(
                None,
                None,
                f"aliases expand the config past {MAX_CONFIG_BYTES} bytes (1 MiB)",
                _mark(event),
            )
        self.sizes[id(node)] = size
        return node

    # types-PyYAML types `anchor` as dict[Any, Node]; PyYAML passes the anchor's name (str | None).
    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:  # type: ignore[override]
        node = super().compose_mapping_node(anchor)  # type: ignore[arg-type]
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    where = "".join(self.path).lstrip(".")
                    raise ComposerError(
                        None,
                        None,
                        f"duplicate key {key.value!r}" + (f" in {where}" if where else ""),
                        key.start_mark,
                    )
                seen.add((key.tag, key.value))
        return node


def _mark(event: yaml.Event) -> Mark | None:
    """The event's start mark. SafeLoader's pure-Python parser makes only yaml.error.Mark; the
    stubs also allow libyaml's Mark, which ComposerError's stubs do not take."""
    mark = event.start_mark
    return mark if isinstance(mark, Mark) else None


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    if isinstance(node, yaml.ScalarNode):
        return len(node.value) + 2
    if isinstance(node, yaml.SequenceNode):
        return 2 + sum(sizes[id(item)] + 1 for item in node.value)
    return 2 + sum(sizes[id(k)] + sizes[id(v)] + 2 for k, v in node.value)


def _yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader: no Python tags
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigSyntaxError(f"invalid YAML{where}: {problem}") from None
