#!/usr/bin/env python3
"""Import circles between the modules of each of Verdict's crates.

A module is a file under <crate>/src (a folder's mod.rs and its files count as one module,
the folder). An edge A -> B is a `crate::B` (or `super::B` from a top-level file) path in A
outside its tests. Prints each strongly connected group of more than one module; exits 1
if there is one.
"""
import os
import re
import sys

CRATES = ["plugin", "eval", "cli", "training", "head-models"]


def module_of(crate_src, path):
    rel = os.path.relpath(path, crate_src)
    top = rel.split(os.sep)[0]
    return top[:-3] if top.endswith(".rs") else top


def strip_tests(text):
    # Drop `#[cfg(test)] mod tests { ... }` blocks (to the end of the file, where they sit)
    # and comments (doc links are not imports).
    i = text.find("#[cfg(test)]\nmod tests")
    text = text if i < 0 else text[:i]
    return re.sub(r"//.*", "", text)


def edges(crate):
    src = os.path.join(crate, "src")
    graph = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            m = module_of(src, path)
            if m in ("lib", "main"):
                continue
            text = strip_tests(open(path).read())
            targets = set(re.findall(r"crate::([a-z_0-9]+)", text))
            # `use crate::{a::x, b::{..}}` groups: the names right after `{` or `,` at depth 1.
            for group in re.findall(r"crate::\{(.*?)\};", text, re.S):
                depth = 0
                token = ""
                for ch in group:
                    if ch == "{":
                        depth += 1
                    elif ch == "}":
                        depth -= 1
                    elif ch == "," and depth == 0:
                        token = ""
                        continue
                    if depth == 0 and ch not in "{}":
                        token += ch
                        name = token.strip().split("::")[0]
                        if name:
                            targets.add(name)
            if os.path.dirname(path) == src:
                targets |= set(re.findall(r"super::([a-z_0-9]+)", text))
            graph.setdefault(m, set()).update(t for t in targets if t != m)
    modules = set(graph)
    return {m: {t for t in ts if t in modules} for m, ts in graph.items()}


def cycles(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    found = False
    for crate in CRATES:
        for group in cycles(edges(crate)):
            found = True
            print(f"{crate}: {' <-> '.join(group)}")
    if not found:
        print("no import circles between modules in " + ", ".join(CRATES))
    sys.exit(1 if found else 0)
