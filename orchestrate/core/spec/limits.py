"""What reading one YAML file may cost: its size, its depth, and what its aliases add.

YAML lets a few hundred bytes describe billions of values: ``&a [x, x, ...]`` names a list and
``*a`` repeats it, so seven levels of ``&aN [*aN-1 x 9]`` are 421 bytes that expand to 4.8
million values (two minutes and 2.8 GB to validate; one level more needs ~25 GB). PyYAML builds
the shared graph cheaply; every walk after it (line numbers, duplicate keys, validation) pays for
the expansion. An alias may also name the collection it sits in (a loop), and a thousand nested
``[`` exhaust Python's recursion in the composer. So, before any walk:

* a file is at most :data:`MAX_FILE_BYTES` (job and inventory files are a few KB; an inventory
  of thousands of nodes names them with hostlists such as ``gpu[0001-4096]``);
* nesting is at most :data:`MAX_DEPTH` levels, in the text and once aliases are expanded;
* aliases may add at most :data:`ALIAS_LIMIT` values (each use of ``*name`` adds every value
  of what it names: scalars, lists and mappings, keys included); small reuse (a shared
  ``env``, the same ``model_args`` twice) is far below it;
* an alias inside the collection it names is refused.

Each refusal is a :class:`~orchestrate.core.errors.UserError` with the file and line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from orchestrate.core.errors import UserError

#: The largest job or inventory file read (2 MiB): a 4,096-node inventory listing every node
#: singly is 0.6 MB.
MAX_FILE_BYTES = 2 * 2**20
#: The deepest nesting of lists and mappings (the job's deepest field is 4 levels down).
MAX_DEPTH = 64
#: The most values aliases may add to a file once expanded.
ALIAS_LIMIT = 100_000


def check_size(size: int, source: str) -> None:
    """Refuse a file of more than :data:`MAX_FILE_BYTES` (``size`` in bytes) before parsing:
    PyYAML reads 0.3-2 MB a second, so ten megabytes would take half a minute."""
    if size > MAX_FILE_BYTES:
        raise UserError.single(
            f"the file is {size / 2**20:.1f} MiB; job and inventory files may be at most "
            f"{MAX_FILE_BYTES // 2**20} MiB",
            source=source,
            hint="is it the right file? An inventory of thousands of nodes names them with "
            "hostlists (gpu[0001-4096])",
        )


class DepthLimit:
    """A composer mixin (before ``yaml.SafeLoader`` in the bases) that refuses nesting deeper
    than :data:`MAX_DEPTH` where it starts, before the composer's recursion runs out."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """PyYAML's ``compose_node``, counting how deep it is."""
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[attr-defined]
                raise TooDeep(mark)
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


class TooDeep(yaml.YAMLError):
    """Nesting past :data:`MAX_DEPTH`, at ``mark``."""

    def __init__(self, mark: yaml.Mark) -> None:
        super().__init__(f"nested more than {MAX_DEPTH} levels deep")
        self.mark = mark


def too_deep(exc: TooDeep, source: str) -> UserError:
    """The refusal of :class:`TooDeep`, at its line."""
    return UserError.single(
        f"lists and mappings nested more than {MAX_DEPTH} levels deep",
        source=source, line=exc.mark.line + 1,
        hint="job and inventory files are a few levels deep: check the brackets on that line",
    )


def check_aliases(root: yaml.Node, source: str) -> None:
    """Refuse a composed document whose aliases loop, nest past :data:`MAX_DEPTH` or add more
    than :data:`ALIAS_LIMIT` values; one pass over the distinct nodes, nothing expanded.

    An alias is the same node object met again: PyYAML shares it. Anchors come before their
    aliases, so a depth-first walk has finished a node before any alias of it is met, and the
    walk is no deeper than the text (itself at most :data:`MAX_DEPTH`).
    """
    if not isinstance(root, yaml.ScalarNode):
        Aliases(source).visit(root, root)


class Aliases:
    """The walk of :func:`check_aliases`: per node, its expanded size and depth."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth), expanded
        self.open: set[int] = set()  # the nodes the walk is inside
        self.added = 0  # values that aliases add

    def visit(self, node: yaml.Node, where: yaml.Node) -> tuple[int, int]:
        """The expanded (values, depth) of the collection ``node``; ``where`` is the node
        whose line names it (the key of a mapping value, else the collection it is in).
        Scalars are counted, not visited: an alias of one adds a single value, no more than
        writing it out would."""
        key = id(node)
        if key in self.open:
            raise self._refuse(where, "an alias refers to itself: it names a list or mapping "
                               "it is in", "an alias (*name) can only repeat a finished anchor "
                               "(&name)")
        known = self.done.get(key)
        if known is not None:  # an alias: its whole expansion once more
            self.added += known[0]
            if self.added > ALIAS_LIMIT:
                raise self._refuse(
                    where, f"aliases (*name) expand the file by more than {ALIAS_LIMIT:,} "
                    "values", "an alias repeats everything its anchor names; more than this "
                    "is an alias bomb, not reuse")
            return known
        self.open.add(key)
        values, depth = 1, 0
        for child, line_of in _children(node):
            if isinstance(child, yaml.ScalarNode):
                values += 1
                continue
            child_values, child_depth = self.visit(child, line_of)
            values = min(values + child_values, ALIAS_LIMIT + 1)  # only "more than" matters
            depth = max(depth, child_depth)
        self.open.discard(key)
        if depth + 1 > MAX_DEPTH:
            raise self._refuse(where, f"aliases nest lists and mappings more than {MAX_DEPTH} "
                               "levels deep", "an alias inside an anchor inside an alias ...: "
                               "write the values out")
        self.done[key] = (values, depth + 1)
        return values, depth + 1

    def _refuse(self, where: yaml.Node, message: str, hint: str) -> UserError:
        return UserError.single(message, source=self.source, line=where.start_mark.line + 1,
                                hint=hint)


def _children(node: yaml.Node) -> Iterator[tuple[yaml.Node, yaml.Node]]:
    """Each child of a collection with the node whose line names it."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key, key
            yield value, key
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield item, node
