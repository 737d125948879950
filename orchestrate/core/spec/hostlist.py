"""Slurm-style hostlists: ``gpu[01-16]``, ``n[1-3,7],login1``.

Inventories name many identical nodes with one hostlist, and Slurm reports allocations the same
way. Expansion is pure string work, so the planner and the training entrypoint can do it without
calling ``scontrol show hostnames``.
"""

from __future__ import annotations

import re

_BRACKET = re.compile(r"\[([^\[\]]*)\]")

#: More names than any cluster has: a typo like ``n[1-100000000]`` is refused at once instead
#: of filling the memory.
MAX_NAMES = 100_000


def expand(hostlist: str) -> list[str]:
    """Expand a hostlist into names, in order; raises ValueError on a malformed one."""
    names: list[str] = []
    for item in _split_top(hostlist):
        names.extend(_expand_one(item))
        _check_size(len(names), hostlist)
    return names


def _check_size(count: int, hostlist: str) -> None:
    if count > MAX_NAMES:
        raise ValueError(f"hostlist {hostlist!r} has more than {MAX_NAMES} names")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    items.append(text[start:])
    stripped = [item.strip() for item in items]
    if any(not item for item in stripped):
        raise ValueError(f"empty name in hostlist {text!r}")
    return stripped


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out: list[str] = []
    rests = _expand_one(tail)
    for part in match.group(1).split(","):
        for value in _range(part.strip(), item):
            out.extend(head + value + rest for rest in rests)
            _check_size(len(out), item)
    return out


def _range(part: str, item: str) -> list[str]:
    if re.fullmatch(r"\d+", part):
        return [part]
    found = re.fullmatch(r"(\d+)-(\d+)", part)
    if found is None:
        raise ValueError(f"bad range {part!r} in hostlist {item!r} (expected N or N-M)")
    low, high = found.group(1), found.group(2)
    if int(high) < int(low):
        raise ValueError(f"range {part!r} runs backwards in hostlist {item!r}")
    _check_size(int(high) - int(low) + 1, item)
    width = len(low) if low.startswith("0") and len(low) > 1 else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def compress(names: list[str]) -> str:
    """A compact hostlist for ``names`` (consecutive numeric suffixes become ranges)."""
    groups: list[tuple[str, list[str]]] = []
    for name in names:
        found = re.fullmatch(r"(.*?)(\d+)", name)
        prefix, number = (found.group(1), found.group(2)) if found else (name, "")
        if groups and groups[-1][0] == prefix and number and groups[-1][1]:
            groups[-1][1].append(number)
        else:
            groups.append((prefix, [number] if number else []))
    parts = []
    for prefix, numbers in groups:
        if not numbers:
            parts.append(prefix)
        elif len(numbers) == 1:
            parts.append(prefix + numbers[0])
        else:
            parts.append(f"{prefix}[{_ranges(numbers)}]")
    return ",".join(parts)


def _ranges(numbers: list[str]) -> str:
    spans: list[list[str]] = []
    for num in numbers:
        last = spans[-1][-1] if spans else ""
        if (
            spans
            and int(num) == int(last) + 1
            # zero padding is kept: 09,10 is a range, and so is 9,10 (but not 9,010)
            and (len(num) == len(last) or not (num.startswith("0") or last.startswith("0")))
        ):
            spans[-1].append(num)
        else:
            spans.append([num])
    return ",".join(s[0] if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)
