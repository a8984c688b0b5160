"""The README and docs/ quote the committed results, and their links lead somewhere.

``benchmarks/render_docs.py --check`` fails when a generated table differs from what the result files in
``benchmarks/results/`` give (a result re-run without re-rendering, or a table edited by hand).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))]


def test_generated_tables_match_the_committed_results():
    checked = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "render_docs.py"), "--check"],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr


def test_every_page_quotes_a_generated_table_where_it_shows_one():
    """A results table pasted by hand (outside a generated block) is what the check above cannot see."""
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        outside = re.sub(r"<!-- generated: ([\w-]+) -->.*?<!-- end generated: \1 -->", "", text, flags=re.S)
        assert "| DeepSpeed ZeRO-2 |" not in outside, f"{page}: a peers' results table outside a generated block"


def test_readme_is_a_front_door_and_links_resolve():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert 150 <= len(readme.splitlines()) <= 200, len(readme.splitlines())
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            assert os.path.exists(path), f"{page} links to {target}, which does not exist"
