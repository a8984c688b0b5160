"""Regenerate the tables that README.md and docs/ quote from the committed results in benchmarks/results/.

    python benchmarks/render_docs.py          # rewrite the generated blocks in place
    python benchmarks/render_docs.py --check  # exit 1, with a diff, if any block differs from the results

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``; NAME picks
the renderer below. ``tests/test_docs.py`` runs ``--check``, so a result file re-run without rendering, or
a table edited by hand, fails the suite.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGES = ("README.md",) + tuple(sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                                     if name.endswith(".md")))
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)


def comparison() -> str:
    """The side-by-side run's table, with its caption and the command and machine it came from."""
    text = open(os.path.join(RESULTS, "comparison", "comparison.md")).read()
    caption, provenance, table = text.strip().split("\n\n", 2)
    return f"{table}\n\n{caption}  \n{provenance}\n"


RENDERERS = {"comparison": comparison}


def render(text: str) -> str:
    def block(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise KeyError(f"unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        return match.group(1) + RENDERERS[name]() + match.group(4)
    return BLOCK.sub(block, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        current = open(path).read()
        rendered = render(current)
        if rendered == current:
            continue
        stale.append(page)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), rendered.splitlines(True), page,
                                                       f"{page} (rendered from benchmarks/results)"))
        else:
            open(path, "w").write(rendered)
    if args.check and stale:
        print(f"\nout of date: {', '.join(stale)}; run python benchmarks/render_docs.py", file=sys.stderr)
        return 1
    print("rewrote " + ", ".join(stale) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
