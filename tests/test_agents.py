#!/usr/bin/env python3
"""AGENTS.md against the tree: every file its "Where is it" table names exists and holds
the function or type named beside it, docs/architecture.md names each of those files
too (the two maps do not disagree), and every #include in src/ follows the one-way
layer rule AGENTS.md draws (a file includes its own layer and the ones below it).

  python3 tests/test_agents.py            (from anywhere; exits 1 naming each problem)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What each layer of src/ may include (AGENTS.md, "Layers").
BELOW = {
    "core": {"core"},
    "io": {"core", "io"},
    "kernels": {"core", "kernels"},
    "comm": {"core", "kernels", "comm"},
    "parallel": {"core", "kernels", "comm", "parallel"},
    "models": {"core", "io", "kernels", "comm", "parallel", "models"},
    "data": {"core", "io", "data"},
    "train": {"core", "io", "kernels", "comm", "parallel", "models", "data", "train"},
    "cli": {"core", "io", "kernels", "comm", "parallel", "models", "data", "train", "cli"},
}


def main():
    problems = []
    agents = open(os.path.join(ROOT, "AGENTS.md")).read()
    architecture = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    rows = re.findall(r"^\| [^|]+ \| (src/[\w/.]+) \| `([\w:]+)` \|$", agents, re.M)
    if len(rows) < 20:
        problems.append(f"AGENTS.md's table has {len(rows)} rows of a file and a name; expected 20 or more")
    for path, name in rows:
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            problems.append(f"AGENTS.md names {path}, which does not exist")
            continue
        text = open(full).read()
        if not re.search(r"(?<![\w:])" + re.escape(name) + r"\b", text):
            problems.append(f"AGENTS.md names {name} in {path}, which does not hold it")
        stem = os.path.splitext(os.path.basename(path))[0]
        if not re.search(r"\b" + re.escape(stem) + r"\.(\{h,cpp\}|h\b|cpp\b|cu\b)", architecture):
            problems.append(f"docs/architecture.md does not name {path} (as {stem}.h, .cpp or .{{h,cpp}})")
    for layer, allowed in BELOW.items():
        folder = os.path.join(ROOT, "src", layer)
        for dirpath, _, files in os.walk(folder):
            for f in files:
                path = os.path.join(dirpath, f)
                for inc in re.findall(r'^#include "(\w+)/', open(path, errors="replace").read(), re.M):
                    if inc not in allowed:
                        problems.append(f"{os.path.relpath(path, ROOT)} includes {inc}/, a layer above {layer}/")
    for p in problems:
        print("FAIL:", p)
    if problems:
        sys.exit(1)
    print(f"PASS: AGENTS.md's {len(rows)} rows exist and docs/architecture.md names their files; includes go one way")


if __name__ == "__main__":
    main()
