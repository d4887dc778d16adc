"""What a compiled program moves between devices: the collectives in its optimized HLO text.

`loop_collectives(hlo)` finds the collectives (all-gather, all-reduce, reduce-scatter,
all-to-all, collective-permute, ...) that run inside a `while` loop of the ENTRY computation
(the sampler's decode loop), following every computation the loop body calls, and gives the
bytes each one produces per device per iteration (its result shape; a tuple result counts
each element, an async `-start` form only its results, not the operands it carries);
`collectives(hlo)` lists every collective with how many devices each of its replica groups
holds. Used by the tests that prove a rollout layout decodes without moving
weights (`loop_collectives`) and that sequence parallelism moves per-row summaries, not the
sequence (`collectives`).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|c64)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(mesh\[[^\]]*\] \{[^}]*\}|\[[\d,]*\]<=\[[\d,]*\]\S*|\{[^=]*?\}\}|\{\})")
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|called_computations)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: `op` (e.g. "all-gather"), its result `shapes`
    [(dtype, dims)], `bytes` per device, the computation it sits in, and `group_size`, the
    devices in each of its replica groups (None when the line names none, e.g. a
    collective-permute's source-target pairs)."""

    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    computation: str
    line: str
    group_size: int | None = None


def _group_size(line: str) -> int | None:
    """Devices per replica group of a collective's HLO line: the explicit {{0,1},{2,3}}, the
    iota [groups,size]<=[devices] or the mesh form mesh['fsdp'=3,'sp'=2] {'sp'}."""
    m = _GROUPS.search(line)
    if m is None or m.group(1) == "{}":
        return None
    groups = m.group(1)
    if groups.startswith("{{"):
        return len(groups[2:].split("}")[0].split(","))
    if groups.startswith("["):
        return int(groups[1:].split("]")[0].split(",")[-1])
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", groups.split("]", 1)[1])]))


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry = None
    name = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
            continue
        if line.strip() == "}":
            name = None
            continue
        if name is not None:
            comps[name].append(line)
    return comps, entry


def _callees(line: str) -> list[str]:
    out = []
    for m in _CALLS.finditer(line):
        out += [c.strip().lstrip("%") for c in m.group(1).strip("{}").split(",") if c.strip()]
    return out


def _result_shapes(line: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    rhs = line.split("=", 1)[1]
    head = rhs.split("(", 1)[0] if not rhs.lstrip().startswith("(") else rhs[: rhs.index(")") + 1]
    return tuple((d, tuple(int(x) for x in dims.split(",") if x))
                 for d, dims in _SHAPE.findall(head))


_CARRY_OPERANDS = ("all-gather", "collective-permute")   # their -start returns operands too


def _produced_shapes(line: str, op: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The shapes a collective produces. The async `all-gather-start` and
    `collective-permute-start` return a tuple of their operands, then their results, then
    scalar context values: only the results count. An `all-reduce-start` returns its results
    alone (a tuple when XLA combined several)."""
    shapes = _result_shapes(line)
    if (op in _CARRY_OPERANDS and len(shapes) > 1
            and re.search(rf"\s{op}-start\(", line.split("=", 1)[1])):
        arrays = [s for s in shapes if s[1]]
        return tuple(arrays[len(arrays) // 2:])
    return shapes


def _op(line: str) -> str | None:
    rhs = line.split("=", 1)[1] if "=" in line else ""
    for op in COLLECTIVES:
        if re.search(rf"\s{op}(-start)?\(", rhs):
            return op
    return None


def collectives(hlo: str, computations: set[str] | None = None) -> list[Collective]:
    """Every collective of `hlo` (in `computations` when given)."""
    comps, _ = _computations(hlo)
    out = []
    for name, lines in comps.items():
        if computations is not None and name not in computations:
            continue
        for line in lines:
            op = _op(line)
            if op is None:
                continue
            shapes = _produced_shapes(line, op)
            nbytes = sum(int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(d, 4)
                         for d, dims in shapes)
            out.append(Collective(op, shapes, nbytes, name, line.strip()[:200], _group_size(line)))
    return out


def loop_collectives(hlo: str) -> list[Collective]:
    """The collectives executed inside the ENTRY computation's while loops (bodies and
    conditions, with everything they call). Raises ValueError when ENTRY has no while loop."""
    comps, entry = _computations(hlo)
    roots = [c for line in comps.get(entry, []) if " while(" in line for c in _callees(line)]
    if not roots:
        raise ValueError("the program's ENTRY computation has no while loop")
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _callees(line)
    return collectives(hlo, seen)
