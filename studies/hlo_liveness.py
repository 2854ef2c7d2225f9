"""Which buffers are live at the peak of a scheduled, optimized HLO module (read from its text).

    python studies/hlo_liveness.py docs/results/scan_hlo_tpu_bfloat16_dots_nb.txt.gz [--top 14]

A structural reading, not XLA's buffer assignment: walking the entry computation in its schedule,
each instruction's result leaves are buffers of their shapes' bytes, live from that instruction
to the last use of any alias of them (`get-tuple-element`, `tuple`, `bitcast`, `while` (in
place), `copy-done`, `slice-done`, a `dynamic-update-slice` fusion (in place)); buffers in an
on-chip memory space (`S(n)` in a layout) count nothing; the entry's outputs are the donated
arguments' buffers and count nothing; at a `while`, its body's own peak (read the same way) is
added. It prints that peak, where it is reached, and the largest buffers live there. What it
leaves out (the heap's packing, memory XLA allocates outside the module's instructions) is what
the compiled temp bytes hold beyond it. The committed HLO files came from
`studies/scan_residuals.py --hlo` on the TPU.
"""

from __future__ import annotations

import argparse
import gzip
import re
from typing import Any

MB = 2**20
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "u64": 8, "s64": 8}
_LEAF = re.compile(r"\b(pred|s8|u8|s32|u32|bf16|f16|f32|u64|s64)\[([0-9,]*)\](\{[^}]*\})?")


def leaf_bytes(shape: str) -> list[int]:
    """Bytes of each leaf of an HLO shape; 0 for a leaf in an on-chip memory space (`S(n)`)."""
    out = []
    for m in _LEAF.finditer(shape):
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        out.append(0 if re.search(r"S\([1-9]\)", m.group(3) or "") else _BYTES[m.group(1)] * n)
    return out


def _closing(s: str, start: int) -> int:
    """The index of the parenthesis that closes the one before `start`."""
    depth = 1
    for i in range(start, len(s)):
        depth += (s[i] == "(") - (s[i] == ")")
        if depth == 0:
            return i
    return len(s)


def parse(text: str) -> dict[str, list[dict]]:
    """`{computation: [instruction, ...]}` in text (schedule) order."""
    comps: dict[str, list[dict]] = {}
    cur = None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            cur = comps.setdefault(("ENTRY " if head.group(1) else "") + head.group(2), [])
            continue
        m = re.match(r"\s*(ROOT )?%([\w.\-]+) = (.*)$", line) if cur is not None and not line.startswith("}") else None
        if line.startswith("}"):
            cur = None
        if m is None or cur is None:
            continue
        rest = m.group(3)
        cut = _closing(rest, 1) + 1 if rest.startswith("(") else rest.index(" ")
        shape, after = rest[:cut], rest[cut:].strip()
        op = re.match(r"([a-z][\w\-]*)\(", after).group(1)
        args = after[len(op) + 1:]
        index, body = re.search(r"index=(\d+)", after), re.search(r"body=%([\w.\-]+)", after)
        cur.append(dict(name=m.group(2), shape=shape, op=op, root=bool(m.group(1)),
                        operands=re.findall(r"%([\w.\-]+)", args[:_closing(args, 0)]),
                        index=index and int(index.group(1)), body=body and body.group(1)))
    return comps


def _refs(ins: list[dict]) -> tuple[dict, dict, dict]:
    """`(refs, size, born)`: each instruction's leaves as buffer ids (None: an argument's or a
    constant's), each buffer's bytes, and the instruction index that defines it."""
    refs: dict[str, list] = {}
    size: dict[int, int] = {}
    born: dict[int, int] = {}

    def new(i: int, b: int) -> int:
        size[len(size)] = b
        born[len(size) - 1] = i
        return len(size) - 1

    for i, x in enumerate(ins):
        op, ops, leaves = x["op"], [refs.get(o, [None]) for o in x["operands"]], leaf_bytes(x["shape"])
        if op in ("parameter", "constant"):
            refs[x["name"]] = [None] * len(leaves)
        elif op == "get-tuple-element":
            refs[x["name"]] = [ops[0][x["index"]] if x["index"] < len(ops[0]) else None]
        elif op == "tuple":
            refs[x["name"]] = [r for o in ops for r in o]
        elif op in ("bitcast", "copy-done") or (op == "fusion" and "dynamic-update-slice" in x["name"]):
            refs[x["name"]] = ops[0][:1] + [None] * (len(leaves) - 1)
        elif op == "while":
            refs[x["name"]] = list(ops[0])
        elif op == "slice-done":
            refs[x["name"]] = ops[0][1:2]
        elif op == "copy-start":
            refs[x["name"]] = [new(i, leaves[0]), ops[0][0], None]
        elif op == "slice-start":
            refs[x["name"]] = [ops[0][0], new(i, leaves[1]), None]
        else:
            refs[x["name"]] = [new(i, b) for b in leaves]
    return refs, size, born


def peak(comps: dict[str, list[dict]], name: str, entry: bool) -> tuple[int, str, list[tuple[int, dict]]]:
    """`(peak bytes, instruction where reached, [(bytes, defining instruction)] live there)`."""
    ins = comps[name]
    refs, size, born = _refs(ins)
    last: dict[int, int] = {}
    for i, x in enumerate(ins):
        for o in x["operands"]:
            for r in refs.get(o, []):
                if r is not None:
                    last[r] = i
    for x in (x for x in ins if x["root"]):
        for r in filter(lambda r: r is not None, refs[x["name"]]):
            size[r] = 0 if entry else size[r]  # the entry's outputs: the donated arguments' buffers
            last[r] = len(ins)
    owner = {r: x for x in reversed(ins) for r in refs[x["name"]] if r is not None}
    live: set[int] = set()
    best: tuple[int, str, set[int]] = (0, "", set())
    for i, x in enumerate(ins):
        live |= {d for d, b in born.items() if b == i}
        inner = peak(comps, x["body"], False)[0] if x["op"] == "while" else 0
        total = sum(size[d] for d in live) + inner
        if total > best[0]:
            best = (total, x["name"], set(live))
        live = {d for d in live if last.get(d, -1) > i}
    return best[0], best[1], sorted(((size[d], owner[d]) for d in best[2]), key=lambda t: -t[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("hlo", nargs="+", help="optimized HLO text files (.gz or plain)")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    for path in args.hlo:
        raw = open(path, "rb").read()
        comps = parse((gzip.decompress(raw) if path.endswith(".gz") else raw).decode())
        entry = next(c for c in comps if c.startswith("ENTRY "))
        total, where, live = peak(comps, entry, True)
        print(f"== {path}: live at the peak {total / MB:.1f} MB, at {where} ({next(x['op'] for x in comps[entry] if x['name'] == where)})")
        for b, x in live[: args.top]:
            print(f"   {b / MB:8.1f} MB  {x['name'][:36]:36s} {x['op']:12s} {x['shape'][:90]}")


if __name__ == "__main__":
    main()
