"""SLURM hostlist expressions (`n[01-03,07]`, `gpu-[1-2],cpu5`, `r[1-2]n[1-2]`) expanded to host names.

SLURM hands every task the job's nodes as one compressed expression; the first host is where rank 0
runs (block distribution), so it is the rendezvous address. `scontrol show hostnames` would do the
same, but a subprocess per rank is slow and scontrol is not always on the compute nodes' PATH.
"""

from __future__ import annotations


def expand_hostlist(expression: str) -> list[str]:
    """Every host named by a SLURM hostlist expression, in SLURM's order (duplicates kept)."""
    hosts: list[str] = []
    for item in _split_top_level(expression.strip()):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(expression: str) -> list[str]:
    """Split at the commas that are not inside brackets: `a[1,2],b` -> [`a[1,2]`, `b`]."""
    items: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(expression):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in hostlist {expression!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expression!r}")
        elif char == "," and depth == 0:
            items.append(expression[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expression!r}")
    items.append(expression[start:])
    return [item for item in items if item]


def _expand_item(item: str) -> list[str]:
    """Expand one host pattern; several bracket groups give their cartesian product, left varies slowest."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_item(rest)
    return [prefix + value + tail for value in _expand_ranges(ranges, item) for tail in tails]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    """`01-03,07` -> [`01`, `02`, `03`, `07`]: zero padding follows the width of the lower bound."""
    values: list[str] = []
    for part in ranges.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        if not sep:
            values.append(low)
            continue
        width = len(low)
        first, last = int(low), int(high)
        if last < first:
            raise ValueError(f"descending range {part!r} in hostlist item {item!r}")
        values.extend(str(number).zfill(width) for number in range(first, last + 1))
    return values
