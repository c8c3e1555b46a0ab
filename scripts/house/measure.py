#!/usr/bin/env python3
"""Measures the house: the library's rooms (top-level modules of src/), the arrows between them
(a `crate::ROOM` path used in another room, or a `crate::Name` that lib.rs re-exports from
ROOM), the loops among them, and the longest functions. Test modules count like any code: a
test that reaches another room is an arrow too.

    python3 scripts/house/measure.py [--src src] [--top 10]

Reads the sources as text (no build, no dependencies): an arrow is any `crate::room` path in
code outside comments, which is what a reader sees; a function's length is its lines from `fn`
to its closing brace, found by brace matching outside strings and comments. A room that takes
its own item through the crate root (`crate::Name` re-exported from itself) is listed as a
round trip through the front door: it hides where the item lives.
"""
import argparse
import collections
import pathlib
import re
import sys


def strip_comments(text):
    """The text with // and /* */ comments and string literals blanked (lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def crate_paths(code):
    """(first segment, offset) of every `crate::x` path, `crate::{x, y::z}` groups included."""
    for m in re.finditer(r"\bcrate::", code):
        rest = code[m.end():]
        if rest.startswith("{"):
            depth, item, j = 0, "", 0
            for j, c in enumerate(rest):
                if c == "{":
                    depth += 1
                    if depth == 1:
                        continue
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        break
                if depth == 1 and c == ",":
                    item = ""
                    continue
                if depth == 1:
                    item += c
                    name = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)(::|\s*[,}]|$)", item)
                    if name and (c == ":" or c.isspace()):
                        yield name.group(1), m.start()
                        item = "\0"
        else:
            name = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", rest)
            if name:
                yield name.group(1), m.start()


def root_exports(lib_code):
    """Name -> room of every item lib.rs re-exports (`pub use room::{A, b::C};`)."""
    out = {}
    for m in re.finditer(r"\bpub\s+use\s+([a-z_][a-z0-9_]*)::(.*?);", lib_code, re.S):
        room, rest = m.group(1), m.group(2)
        for name in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)(\s*::)?", rest):
            if not name.group(2):
                out[name.group(1)] = room
    return out


def room_of(path, src):
    rel = path.relative_to(src)
    return rel.parts[0].removesuffix(".rs") if len(rel.parts) > 1 else rel.stem


def functions(code, path):
    """(lines, name, file:line) of every fn with a body."""
    found = []
    for m in re.finditer(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)", code):
        start = m.start()
        brace = code.find("{", m.end())
        semi = code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue
        depth, j = 0, brace
        while j < len(code):
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        first = code.count("\n", 0, start) + 1
        last = code.count("\n", 0, j) + 1
        found.append((last - first + 1, m.group(1), f"{path}:{first}"))
    return found


def loops(edges, rooms):
    """Strongly connected components with more than one room (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(rooms):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="src")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    src = pathlib.Path(args.src)
    # lib.rs is the front door (module list and re-exports), not a room.
    files = sorted(f for f in src.rglob("*.rs") if f != src / "lib.rs")
    lines = collections.Counter()
    nfiles = collections.Counter()
    edges = collections.defaultdict(set)
    witness = {}
    funcs = []
    exports = root_exports(strip_comments((src / "lib.rs").read_text())) if (src / "lib.rs").exists() else {}
    round_trips = []
    front_door = []
    for f in files:
        room = room_of(f, src)
        text = f.read_text()
        lines[room] += text.count("\n")
        nfiles[room] += 1
        code = strip_comments(text)
        for target, at in crate_paths(code):
            where = f"{f}:{code.count(chr(10), 0, at) + 1}"
            if not ((src / target).is_dir() or (src / f"{target}.rs").exists()):
                if target not in exports:
                    continue
                # A path through lib.rs's re-exports, in a `use` line, a signature or a body
                # alike: an arrow from the room up to the front door, whichever room the item
                # lives in.
                front_door.append(f"{room}: crate::{target} ({where})")
                if exports[target] == room:
                    round_trips.append(f"{room}: crate::{target} ({where})")
                    continue
                target = exports[target]
            if target != room:
                edges[room].add(target)
                witness.setdefault((room, target), where)
        funcs += functions(code, f)
    rooms = sorted(lines)
    print(f"rooms: {len(rooms)}")
    for r in rooms:
        print(f"  {r:<12} {nfiles[r]:>3} files {lines[r]:>6} lines")
    print(f"arrows: {sum(len(v) for v in edges.values())}")
    for a in rooms:
        for b in sorted(edges[a]):
            print(f"  {a} -> {b}   ({witness[(a, b)]})")
    print(f"paths through the front door (crate::Item re-exported by lib.rs): {len(front_door)}")
    for r in front_door:
        print(f"  {r}")
    print(f"round trips through the front door: {len(round_trips)}")
    for r in round_trips:
        print(f"  {r}")
    cycles = loops(edges, rooms)
    print(f"loops: {len(cycles)}")
    for c in cycles:
        print("  " + " <-> ".join(c))
    if not cycles:
        # Without loops the rooms stack into floors: a room's floor is one above the highest
        # room it uses, so every arrow points down.
        floor = {}

        def level(r):
            if r not in floor:
                floor[r] = 1 + max((level(t) for t in edges[r]), default=-1)
            return floor[r]

        for r in rooms:
            level(r)
        print("floors (every arrow points down):")
        for f in range(max(floor.values()) + 1):
            print(f"  {f}: " + ", ".join(r for r in rooms if floor[r] == f))
    print(f"longest functions (top {args.top}):")
    for n, name, at in sorted(funcs, reverse=True)[: args.top]:
        print(f"  {n:>4} {name} ({at})")


if __name__ == "__main__":
    main()
