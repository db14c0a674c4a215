"""YAML job configs, read with PyYAML's safe loader under the limits of `muster.shared.loader`: aliases
counted, the size a node would expand to worked out as it is composed, keys written twice
refused. Its own module so that only YAML submissions import PyYAML."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.error import Mark

from muster.shared.configlimits import MAX_CONFIG_BYTES, MAX_YAML_ALIASES


class ConfigYAMLError(ValueError):
    """The YAML is invalid or over a limit; the message says where and why."""


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


def _as_written(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return loader.construct_scalar(node)  # type: ignore[arg-type]


# A date or time (`RELEASE: 2024-05-01`) stays the text it was written as, as it would in JSON:
# PyYAML's date objects have no JSON form, so the config could be neither checked nor sent.
_BoundedLoader.add_constructor("tag:yaml.org,2002:timestamp", _as_written)

_JSON_SCALARS = (str, int, float, bool, type(None))


def _not_json(value: Any) -> str | None:
    """Where in `value` something has no JSON form (`!!binary`, `!!set`), with what it is; None if
    nothing. Iterative, as deep as the parser went."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        elif not isinstance(item, _JSON_SCALARS):
            what = "binary data" if isinstance(item, bytes) else f"a {type(item).__name__}"
            return f"{path or 'the config'}: {what} has no JSON form; write it as text"
    return None


def load(text: str) -> Any:
    try:
        value = yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader: no Python tags
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigYAMLError(f"invalid YAML{where}: {problem}") from None
    if (problem := _not_json(value)) is not None:
        raise ConfigYAMLError(f"invalid YAML: {problem}")
    return value
