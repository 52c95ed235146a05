#!/usr/bin/env python3
"""AGENTS.md against the tree: every file its "Where is it" table names exists and holds
the function or type named beside it, docs/architecture.md names each of those files
too (the two maps do not disagree), and every #include in src/ follows the one-way
layer rule AGENTS.md draws (a file includes its own layer and the ones below it).

The first pages stay short: README.md at most 250 lines, docs/architecture.md at most
400 (issue 59: the rest lives on docs/'s topic pages). And no link dangles: every
relative markdown link in README.md, AGENTS.md and docs/**/*.md names a file that
exists and, where it has a #anchor into a .md file, a heading of that file (GitHub's
anchors: lowercase, spaces to '-', other punctuation than '-' and '_' dropped, a
repeated heading's anchor suffixed -1, -2, ...).

The code stays readable in pieces (issue 59): no file of src/ over 1,000 lines, and
Trainer::step, the step's story, at most 60 lines from its signature to its closing brace.

  python3 tests/test_agents.py            (from anywhere; exits 1 naming each problem)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first pages' length limits (issue 59, item 6).
MAX_LINES = {"README.md": 250, os.path.join("docs", "architecture.md"): 400}
MAX_SRC_LINES = 1000
MAX_STEP_LINES = 60
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


def unfenced(text):
    """The lines of a markdown text outside fenced code blocks."""
    fence = None
    for line in text.split("\n"):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
        else:
            yield line


def outside_code(text):
    """The lines of a markdown text outside fenced code blocks, with inline code spans
    blanked (a link or heading inside code is not one)."""
    return [re.sub(r"`[^`]*`", "``", line) for line in unfenced(text)]


def anchor(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower().replace(" ", "-")
    return "".join(c for c in text if c.isalnum() or c in "-_")


def anchors(path):
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub does."""
    seen, found = {}, set()
    with open(path) as f:
        # Headings' own text, code spans included (outside_code blanks them for links).
        text = f.read()
    for line in unfenced(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        found.add(a if n == 0 else f"{a}-{n}")
    return found


def markdown_files():
    files = ["README.md", "AGENTS.md"]
    for dirpath, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in sorted(names) if n.endswith(".md")]
    return files


def link_problems():
    problems, checked = [], 0
    for md in markdown_files():
        full = os.path.join(ROOT, md)
        with open(full) as f:
            text = f.read()
        for number, line in enumerate(outside_code(text), 1):
            for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                checked += 1
                path, _, frag = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(full), path)) if path else full
                if not os.path.exists(dest):
                    problems.append(f"{md}: link to {target}: {os.path.relpath(dest, ROOT)} does not exist")
                    continue
                if frag and dest.endswith(".md") and frag not in anchors(dest):
                    problems.append(f"{md}: link to {target}: {os.path.relpath(dest, ROOT)} has no heading #{frag}")
    return problems, checked


def main():
    problems = []
    for page, most in MAX_LINES.items():
        with open(os.path.join(ROOT, page)) as f:
            count = len(f.read().splitlines())
        if count > most:
            problems.append(f"{page} has {count} lines; at most {most} (move the rest to a topic page in docs/)")
    dangling, links = link_problems()
    problems += dangling
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
    for dirpath, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in files:
            with open(os.path.join(dirpath, f), errors="replace") as src:
                count = len(src.read().splitlines())
            if count > MAX_SRC_LINES:
                problems.append(f"{os.path.relpath(os.path.join(dirpath, f), ROOT)} has {count} lines; at most "
                                f"{MAX_SRC_LINES} (split it along its mechanisms)")
    trainer = open(os.path.join(ROOT, "src", "train", "trainer.cpp")).read().splitlines()
    first = next((i for i, line in enumerate(trainer) if line.startswith("StepResult Trainer::step()")), None)
    if first is None:
        problems.append("src/train/trainer.cpp holds no StepResult Trainer::step()")
    else:
        last = next(i for i in range(first, len(trainer)) if trainer[i] == "}")
        if last - first + 1 > MAX_STEP_LINES:
            problems.append(f"Trainer::step is {last - first + 1} lines; at most {MAX_STEP_LINES} (a phase a function)")
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
    print(f"PASS: AGENTS.md's {len(rows)} rows exist and docs/architecture.md names their files; includes go one way;"
          f" README.md and docs/architecture.md within {MAX_LINES['README.md']} and"
          f" {MAX_LINES[os.path.join('docs', 'architecture.md')]} lines; {links} relative links resolve; src files"
          f" within {MAX_SRC_LINES} lines, Trainer::step within {MAX_STEP_LINES}")


if __name__ == "__main__":
    main()
