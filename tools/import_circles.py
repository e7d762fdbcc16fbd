#!/usr/bin/env python3
"""Import circles between the modules of each crate of the workspace.

A module imports another when it names it in a `use crate::…`, `use super::…` or an inline
`crate::…`/`super::…` path (outside `#[cfg(test)]` modules and comments). A circle is a set
of modules that import each other, directly or through others. The crate root's re-exports
count too: `use crate::LockError` is an import of `lib.rs`, which imports `error`, so code
names the module that defines an item.

    python3 tools/import_circles.py          # every crate and example; exits 1 on a circle

A folder (a `mod.rs` or `name.rs` beside `name/`, the files in it and the folders inside it)
is one room: its files may name each other (a `mod.rs` re-exports its children, and they
name the types it defines), and a circle is counted between rooms only. The circles inside
a room are printed too, for information.

Not seen: a name that comes in through a glob import (`use super::*;` then `b::f()`) and
whatever a macro expands to. A declared module whose file cannot be found stops the check.
"""

import os
import re
import sys

ROOTS = [
    "distlock-runtime/src/lib.rs",
    "distlock-macros/src/lib.rs",
    "src/lib.rs",
    "src/bin/distlock/main.rs",
    "tests/integration/main.rs",
    "tests/ui/ui.rs",
] + sorted(os.path.join("examples", f) for f in os.listdir(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
) if f.endswith(".rs"))


def blank(match):
    return re.sub(r"[^\n]", " ", match.group(0))


def code_of(text):
    """The text with comments, strings and chars blanked out (lines kept)."""
    pattern = re.compile(
        r'//[^\n]*|/\*.*?\*/|r(#*)".*?"\1|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\]){1,8}\'',
        re.S,
    )
    return pattern.sub(blank, text)


def block_end(code, at):
    """Where the block whose `{` ends just before `at` closes."""
    depth = 1
    while depth and at < len(code):
        depth += {"{": 1, "}": -1}.get(code[at], 0)
        at += 1
    return at


# `#[cfg(test)]` or `#[cfg(all(test, …))]`, then any other attributes: a test module.
TEST_CFG = r"#\[cfg\((?:test|all\(\s*test\b[^\]]*\))\)\]\s*(?:#\[[^\]]*\]\s*)*"


def test_spans(code):
    """The inline test modules: tests, not imports (a test module in a file of its own is
    left out of the tree by `modules`)."""
    spans = []
    pattern = TEST_CFG + r"(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{"
    for found in re.finditer(pattern, code):
        spans.append((found.start(), block_end(code, found.end())))
    return spans


def inline_spans(code):
    """The inline modules (`mod name { … }`): a `super::` inside one names its own module."""
    return [
        (found.end(), block_end(code, found.end()))
        for found in re.finditer(r"\bmod\s+\w+\s*\{", code)
    ]


def modules(root):
    """Every module of the crate: its path (a tuple) -> its file."""
    found = {}
    ROOMS.clear()

    def walk(path, file, children_dir, room):
        found[path] = file
        ROOMS[path] = room
        text = open(file).read()
        code = code_of(text)
        inline = inline_spans(code)
        for decl in re.finditer(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?\bmod\s+(\w+)\s*;", code):
            attributes, name = text[decl.start(1) : decl.end(1)], decl.group(2)
            if re.match(TEST_CFG + "$", attributes):
                continue
            if any(a <= decl.start() < b for a, b in inline):
                sys.exit(f"{file}: `mod {name};` inside an inline module: not followed")
            explicit = re.findall(r'\bpath\s*=\s*"([^"]+)"', attributes)
            if explicit:
                child = os.path.normpath(os.path.join(os.path.dirname(file), explicit[-1]))
            else:
                child = os.path.join(children_dir, name + ".rs")
                if not os.path.exists(child):
                    child = os.path.join(children_dir, name, "mod.rs")
            if not os.path.exists(child):
                sys.exit(f"{file}: the file of `mod {name};` is not found")
            # A `mod.rs`, or a file given by `#[path]`, has its children beside it.
            beside = child.endswith("mod.rs") or explicit
            grandchildren = os.path.dirname(child) if beside else child[:-3]
            folder = child.endswith("mod.rs") or os.path.isdir(child[:-3])
            # A folder is one room with the folders inside it.
            inner = room if room else (path + (name,) if folder else ())
            walk(path + (name,), child, grandchildren, inner)

    walk((), root, os.path.dirname(root), ())
    return found


# The room of each module: the outermost folder its file belongs to (none for the files
# beside `lib.rs`/`main.rs`: each is a room of its own).
ROOMS = {}


def use_paths(tree):
    """`crate::{a, b::{c, d}}` -> [[crate, a], [crate, b, c], [crate, b, d]]."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def split(body):
        parts, depth, current = [], 0, ""
        for ch in body:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += ch
        return parts + [current] if current else parts

    def expand(body, prefix):
        paths = []
        for part in split(body):
            if "{" in part:
                head, inner = part[: part.index("{")], part[part.index("{") + 1 : part.rindex("}")]
                paths += expand(inner, prefix + [s for s in head.split("::") if s])
            else:
                paths.append(prefix + [s for s in part.split("::") if s])
        return paths

    return expand(tree, [])


def imports(path, file, mods):
    code = code_of(open(file).read())
    tests = test_spans(code)
    inline_mods = inline_spans(code)
    paths = []
    children = {m[-1] for m in mods if len(m) == len(path) + 1 and m[:-1] == path}
    uses = list(re.finditer(r"\buse\s+([^;]*);", code))
    for use in uses:
        paths += [(p, use.start()) for p in use_paths(use.group(1))]
    inside_use = [(u.start(), u.end()) for u in uses]
    for inline in re.finditer(r"(?<![\w:])((?:crate|super|\w+)(?:::\w+)+)", code):
        if not any(a <= inline.start() < b for a, b in inside_use):
            paths.append((inline.group(1).split("::"), inline.start()))
    targets = set()
    for segments, at in paths:
        if any(a <= at < b for a, b in tests):
            continue
        if segments[0] == "crate":
            base, rest = (), segments[1:]
        elif segments[0] in children:
            base, rest = path, segments
        elif segments[0] not in ("super", "self"):
            continue
        else:
            base, rest = path, segments
            # Each inline module around the path is one `super` of its own.
            for a, b in inline_mods:
                if a <= at < b and rest and rest[0] == "super":
                    rest = rest[1:]
            while rest and rest[0] in ("super", "self"):
                base = base[:-1] if rest[0] == "super" else base
                rest = rest[1:]
        target = base
        for segment in rest:
            if target + (segment,) not in mods:
                break
            target += (segment,)
        if target != path:
            targets.add(target)
    return targets


def room_of(path):
    """A module's room: the modules of a folder are one; every other file is its own."""
    room = ROOMS[path]
    return room if room and path[: len(room)] == room and path != () else path


def circles(graph):
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, found = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def main():
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    failed = False
    for root in ROOTS:
        mods = modules(root)
        graph = {path: imports(path, file, mods) for path, file in mods.items()}
        rooms = {}
        for path, targets in graph.items():
            room = rooms.setdefault(room_of(path), set())
            room.update(room_of(t) for t in targets if room_of(t) != room_of(path))
        between = circles(rooms)
        inside = circles(graph)
        print(
            f"{root}: {len(mods)} modules in {len(rooms)} rooms, {len(between)} import circles"
            f" between rooms ({len(inside)} inside a room)"
        )
        for component in between:
            failed = True
            names = sorted("::".join(p) or "crate" for p in component)
            print("  circle:", ", ".join(names))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
