"""The only YAML loader the product uses: PyYAML's safe loader with alias expansion bounded.

Aliases are cheap to parse and expensive to use: PyYAML shares the aliased node, so a 351-byte
"billion laughs" document loads quickly as a graph, and then validating, copying or serializing it
walks ~10^9 nodes (gigabytes, minutes). Every document is therefore checked as composed, before any
Python object is built: at most MAX_ALIASES alias uses, and at most MAX_EXPANDED_NODES nodes once every
alias is expanded (counted over the graph with memoization, so the check itself is linear). Hand-written
manifests use a handful of aliases, if any; generated ones use none.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_ALIASES = 100
MAX_EXPANDED_NODES = 100_000


class NoAliasDumper(yaml.SafeDumper):
    """Writes what the product generates (CRD, manifests) with every value spelled out: no anchors or
    aliases, which the reader would have to expand (see above) and which a person cannot read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class YamlBombError(yaml.YAMLError):
    """The document expands (through aliases) beyond what any real input needs."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str | bytes, name: str | None = None) -> None:
        super().__init__(stream)
        self._aliases = 0
        if name is not None:
            self.name = name  # what every error's mark says instead of "<unicode string>"

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise YamlBombError(
                    f"more than {MAX_ALIASES} YAML aliases (*name) in one document{mark}: "
                    "refused to expand them (write the values out)"
                )
        return super().compose_node(parent, index)

    def compose_document(self) -> Node | None:
        self._aliases = 0
        node: Node | None = super().compose_document()
        if node is not None:
            size = _expanded_size(node, {})
            if size > MAX_EXPANDED_NODES:
                raise YamlBombError(
                    f"the YAML document expands through its aliases to more than {MAX_EXPANDED_NODES} "
                    "nodes: refused (an alias bomb?)"
                )
        return node


def _expanded_size(node: Node, sizes: dict[int, int]) -> int:
    """Nodes of the tree `node` stands for once every alias is expanded; stops counting past the bound.

    Iterative (a deeply nested document must not hit the recursion limit) and memoized by node
    identity, so a shared node is walked once however often it is aliased. A cycle (an anchor used
    inside itself) counts as past the bound.
    """
    stack: list[tuple[Node, bool]] = [(node, False)]
    in_progress: set[int] = set()
    while stack:
        current, children_done = stack.pop()
        key = id(current)
        if key in sizes:
            continue
        children = _children(current)
        if children_done:
            in_progress.discard(key)
            total = 1
            for child in children:
                total += sizes.get(id(child), MAX_EXPANDED_NODES + 1)
                if total > MAX_EXPANDED_NODES:
                    break
            sizes[key] = min(total, MAX_EXPANDED_NODES + 1)
            continue
        if key in in_progress:
            return MAX_EXPANDED_NODES + 1  # recursive alias
        in_progress.add(key)
        stack.append((current, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(node)]


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def describe_error(error: yaml.YAMLError, source: str) -> str:
    """`source:LINE:COLUMN: what is wrong` for a syntax error (lines and columns from 1), else
    `source: error`."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        problem = error.problem or error.context or "invalid YAML"
        if mark is not None:
            context = f" ({error.context})" if error.context and error.problem else ""
            return f"{source}:{mark.line + 1}:{mark.column + 1}: {problem}{context}"
    return f"{source}: {error}"


class YamlValueError(yaml.YAMLError):
    """A value Python cannot hold as written (a 5000-digit integer), or nesting past the stack."""


def load(text: str | bytes, name: str | None = None) -> Any:
    """One YAML (or JSON) document, with aliases bounded; raises yaml.YAMLError (YamlBombError). `name`
    (the file's) is what errors name as the place."""
    loader = _BoundedLoader(text, name)
    try:
        return loader.get_single_data()
    except (ValueError, OverflowError) as error:
        raise YamlValueError(f"a value cannot be read: {error}") from None
    except RecursionError:
        raise YamlValueError("the document is nested too deeply") from None
    finally:
        loader.dispose()


def load_all(text: str | bytes, name: str | None = None) -> list[Any]:
    """Every document of a YAML stream, each with aliases bounded; raises yaml.YAMLError. `name` (the
    file's) is what errors name as the place."""
    loader = _BoundedLoader(text, name)
    try:
        documents = []
        while loader.check_data():  # type: ignore[no-untyped-call]
            documents.append(loader.get_data())
        return documents
    except (ValueError, OverflowError) as error:
        raise YamlValueError(f"a value cannot be read: {error}") from None
    except RecursionError:
        raise YamlValueError("the document is nested too deeply") from None
    finally:
        loader.dispose()
