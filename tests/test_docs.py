"""The README and docs/ quote the committed results and the code as it is, and their links lead somewhere.

``benchmarks/render_docs.py --check`` fails when a generated table differs from what the result files in
``benchmarks/results/`` give (a result re-run without re-rendering, or a table edited by hand).
``docs/render_api.py`` regenerates docs/api.md from the public names' signatures and docstrings; the page
must equal what it gives now (a signature or docstring changed without re-rendering, or the page edited).
"""

import difflib
import functools
import importlib.util
import inspect
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))
                         if name.endswith(".md")]
GENERATED = re.compile(r"<!-- generated: ([\w-]+) -->.*?<!-- end generated: \1 -->", re.S)
# a measured figure: a ratio (1.13x), a speed (1,515 M/s), a time (15 ms), a share (1.20%)
FIGURE = re.compile(r"\b\d+\.\d+x\b|M/s\b|\b\d+(?:\.\d+)? ms\b|\b\d+\.\d+%")


@functools.lru_cache(maxsize=None)
def render_api():
    """docs/render_api.py, imported without leaving a __pycache__ in docs/."""
    spec = importlib.util.spec_from_file_location("render_api", os.path.join(ROOT, "docs", "render_api.py"))
    module = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module


@functools.lru_cache(maxsize=None)
def rendered_api() -> str:
    return render_api().render()


def test_generated_tables_match_the_committed_results():
    checked = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "render_docs.py"), "--check"],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr


def test_every_page_quotes_a_generated_table_where_it_shows_one():
    """A results table pasted by hand (outside a generated block) is what the check above cannot see: no table
    row outside one may hold a measured figure (docs/api.md is generated whole, from the docstrings)."""
    for page in PAGES:
        if page == os.path.join("docs", "api.md"):
            continue
        text = open(os.path.join(ROOT, page)).read()
        outside = GENERATED.sub("", text)
        assert "| DeepSpeed ZeRO-2 |" not in outside, f"{page}: a peers' results table outside a generated block"
        for line in outside.splitlines():
            assert not (line.startswith("|") and FIGURE.search(line)), (
                f"{page}: a table row with measured figures outside a generated block (add a renderer to "
                f"benchmarks/render_docs.py that reads benchmarks/results/): {line[:160]}")


RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)x\b")
# a measured amount: a number with its unit, or one of a list ending in one ("217, 334 and 1067 ms", "0.98-1.13%")
MEASURED = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?=(?:(?:,| and| to|-|–)\s*\d+(?:\.\d+)?)*\s?"
                      r"(?:ms|µs|ns|s|%|MiB|GiB|MB|GB|M/s)(?!\w))")
# a target or a bound, not a measurement: "≤ 0.95x", "within 1.05x", "at most 1.2x"
TARGET = re.compile(r"(?:≤|<=|≥|>=|<|>|within|at most|at least|under|below|above)\s*$")
RESULT_PATH = re.compile(r"benchmarks/results/[\w./-]*\w")
SCRIPT = re.compile(r"benchmarks/(\w+)\.py")


@functools.lru_cache(maxsize=None)
def _committed_results() -> dict:
    """Every committed result under benchmarks/results/ (.md, .json, .csv): its path from the root -> its text."""
    results = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "benchmarks", "results")):
        for name in sorted(names):
            if name.endswith((".md", ".json", ".csv")):
                path = os.path.join(folder, name)
                results[os.path.relpath(path, ROOT)] = open(path, errors="replace").read()
    return results


def _cited_results(paragraph: str) -> set:
    """The committed results a paragraph names: a path under benchmarks/results/ (a file, its stem or a folder), or
    a benchmark script ``benchmarks/<stem>.py`` (the results named after it, or in a folder of that name)."""
    results, cited = _committed_results(), set()
    for path in RESULT_PATH.findall(paragraph):
        cited |= {name for name in results if name == path or name.startswith((path + "/", path + "."))}
    for stem in SCRIPT.findall(paragraph):
        cited |= {name for name in results if os.path.basename(name).startswith(stem) or f"/{stem}/" in name}
    return cited


def _unsourced(figures: re.Pattern, prose_of, uncited_from_generated: bool) -> list:
    """Each match of ``figures`` (group 1: the number) in a paragraph of the README or docs/ (``prose_of`` its text
    searched) that is not a target or bound and stands in none of its sources: the committed results the paragraph
    names, or, where it names none, the page's generated tables if ``uncited_from_generated`` (else it is skipped)."""
    results, unsourced = _committed_results(), []
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        generated = "\n".join(match.group(0) for match in GENERATED.finditer(text))
        for paragraph in re.split(r"\n\s*\n", GENERATED.sub("", text)):
            cited = _cited_results(paragraph)
            if not cited and not uncited_from_generated:
                continue
            sources, prose = [results[name] for name in cited] if cited else [generated], prose_of(paragraph)
            for match in figures.finditer(prose):
                if not TARGET.search(prose[max(0, match.start() - 30):match.start()]) and not any(
                        match.group(1) in source for source in sources):
                    unsourced.append((page, prose[max(0, match.start() - 40):match.end() + 8],
                                      sorted(cited) or "the page's generated tables"))
    return unsourced


def test_every_ratio_in_the_prose_is_in_the_result_it_comes_from():
    """A ratio quoted in the README or docs/ (``0.94x``) stands in the committed result its paragraph names
    (a path under benchmarks/results/, or the benchmark script that writes it), or, where the paragraph names none,
    in a table generated into the same page. Targets and bounds ("≤ 0.95x") are not measurements. So a figure from
    a run that was not kept, or computed by hand, or matching some other file by chance, cannot stand unseen."""
    unsourced = _unsourced(RATIO, lambda paragraph: paragraph, uncited_from_generated=True)
    assert not unsourced, f"ratios not in the result their paragraph names: {unsourced}"


def test_every_measured_amount_in_the_prose_is_in_the_result_its_paragraph_names():
    """A time, share or size (``1067 ms``, ``+3.69 µs``, ``4.19%``, ``233 MiB``) quoted in a paragraph that names a
    committed result stands in that result, as ratios must: the figures that used to be generated tables stay
    checked when a result is re-run. Code spans and link targets (commands, paths) are not figures."""
    unsourced = _unsourced(MEASURED, lambda paragraph: re.sub(r"`[^`]*`|\]\([^)]*\)", "", paragraph),
                           uncited_from_generated=False)
    assert not unsourced, f"measured amounts not in the result their paragraph names: {unsourced}"


def test_user_docs_do_not_speak_of_the_teams_work():
    """No sentence of the README or docs/ speaks of the team's sessions or issue numbers."""
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        found = re.findall(r"[^.\n]*\b(?:issue \d+|issues? (?:was|were) filed|the issue's|this session)\b[^.\n]*", text,
                           re.I)
        assert not found, f"{page}: {found}"


def test_api_reference_is_generated_from_the_code():
    """docs/api.md, and docs/usage.md's options table, are what docs/render_api.py renders from the code now."""
    usage = open(os.path.join(ROOT, "docs", "usage.md")).read()
    for name, current, rendered in [("docs/api.md", open(os.path.join(ROOT, "docs", "api.md")).read(), rendered_api()),
                                    ("docs/usage.md", usage, render_api().rendered_usage(usage))]:
        diff = "".join(list(difflib.unified_diff(current.splitlines(True), rendered.splitlines(True), name,
                                                 f"{name} (rendered from the code)"))[:80])
        assert current == rendered, f"{name} is out of date: run python docs/render_api.py\n{diff}"


def test_api_reference_documents_every_option():
    """Each constructor option of ShardedOptimizer and ZeroTrainer has an entry in its docstring's Args section,
    and each entry there is a parameter."""
    module = render_api()
    rendered = rendered_api()
    assert module.UNDOCUMENTED not in rendered and module.NOT_A_PARAMETER not in rendered, [
        line for line in rendered.splitlines() if module.UNDOCUMENTED in line or module.NOT_A_PARAMETER in line]
    import zeroimpl

    documented = set(re.findall(r"^\| `(\w+)` \|", rendered.split("### ShardedOptimizer", 1)[1].split("\n### ")[0],
                                re.M))
    assert set(inspect.signature(zeroimpl.ShardedOptimizer).parameters) - {"optimizer_kwargs"} <= documented
    assert "device_mesh" in documented


def test_usage_options_table_names_every_keyword_option():
    """docs/usage.md's options table (generated) lists exactly ShardedOptimizer's keyword-only options."""
    import zeroimpl

    usage = open(os.path.join(ROOT, "docs", "usage.md")).read()
    section = usage.split("### Options (keyword-only)", 1)[1].split("\n\n")[1]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    keyword_only = [p.name for p in inspect.signature(zeroimpl.ShardedOptimizer).parameters.values()
                    if p.kind is p.KEYWORD_ONLY]
    assert sorted(listed) == sorted(keyword_only), (sorted(set(keyword_only) - set(listed)),
                                                    sorted(set(listed) - set(keyword_only)))


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
