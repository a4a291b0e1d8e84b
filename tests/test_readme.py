"""README.md and docs/*.md name only files inside the repository, and every file they name exists;
the README's runnable examples run as written (from a directory that is not the repository)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:mmserve|tests|bench|docs|scripts)/[\w./-]*)`")
EXAMPLE = re.compile(r"<!-- tests/test_readme.py runs this block (.*?) -->\n```python\n(.*?)^```", re.M | re.S)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a `# comment` there is no heading)."""
    return FENCE.sub("", page.read_text())


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", _prose(page), re.M)}


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_points_to_a_file_in_the_repository():
    problems = []
    for page in PAGES:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_relative_to(ROOT):
                problems.append(f"{page.name}: {target} leaves the repository")
            elif not dest.exists():
                problems.append(f"{page.name}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.name}: {target}: no heading makes #{anchor}")
    assert not problems, "\n".join(problems)


def test_no_link_or_path_climbs_out_of_its_place():
    """The README sits at the root: nothing in it starts with ../ (a clone has nothing above it).
    A docs/ page reaches the repository's other files with ../ (checked above to stay inside);
    no page names a path above the repository in code either."""
    readme = README.read_text()
    assert not re.findall(r"(?:^|[\s(`'\"])\.\./", readme), "README.md names a path starting with ../"
    for page in PAGES:
        assert not re.findall(r"`\.\./", page.read_text()), f"{page.name} names a path starting with ../"
        for target in _relative_links(page):
            if page == README or target.startswith("../"):
                assert (page.parent / target.partition("#")[0]).resolve().is_relative_to(ROOT), (page.name, target)


def test_repository_paths_named_in_code_exist():
    missing = [f"{page.name}: {p}" for page in PAGES for p in CODE_PATH.findall(page.read_text())
               if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, "\n".join(missing)


def _examples(where: str, exact: bool = False) -> list[str]:
    found = [code for kind, code in EXAMPLE.findall(README.read_text()) if (where == kind if exact else where in kind)]
    assert found, f"README.md has no example marked 'runs this block {where}'"
    return found


def _expected(code: str) -> list[str]:
    """The answers an example promises in comments: `print(...)   # red`."""
    return re.findall(r"^\s*print\(.*\)\s+# (\w+)\s*$", code, re.M)


def _run_against(server, code: str, namespace: dict) -> str:
    """Runs a README block pointed at `server`; what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), namespace)
    return out.getvalue()


def test_readme_http_example_answers(demo_server):
    (code,) = _examples("against a demo server", exact=True)
    assert "http://127.0.0.1:8000" in code
    out = _run_against(demo_server, code, {})
    assert _expected(code) and all(word in out.split() for word in _expected(code)), out


def test_readme_tool_calling_example_gives_a_valid_call(demo_server):
    """Issue 44: the example gave 256 tokens of colour words and invalid JSON on `demo`. Run after
    ask.py (whose `client` and `messages` it reuses), it must answer one call, within its
    `max_tokens`, whose arguments parse as JSON and validate against the schema it sent."""
    (ask,) = _examples("against a demo server", exact=True)
    (code,) = _examples("after the ask.py block")
    namespace: dict = {}
    _run_against(demo_server, ask, namespace)
    out = _run_against(demo_server, code, namespace)
    r, tool = namespace["r"], namespace["tools"][0]["function"]
    choice = r.choices[0]
    # "tool_calls", not "length": the call closed within the example's max_tokens
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, (choice, r.usage)
    assert [c.function.name for c in choice.message.tool_calls] == [tool["name"]] == out.split()[:1], out
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), tool["parameters"])


def test_readme_embedded_examples_run_from_another_directory(tmp_path):
    examples = _examples("from a temporary directory")
    procs = []
    for i, code in enumerate(examples):
        (tmp_path / f"example{i}.py").write_text(code)
        procs.append(subprocess.Popen([sys.executable, f"example{i}.py"], cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for code, p in zip(examples, procs):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, (code, stderr[-3000:])
        assert stdout.strip(), code
        assert all(word in stdout.split() for word in _expected(code)), (code, stdout)
        assert not stdout.lstrip().startswith("{"), "logs on stdout"


# -- the README's figures: each tied to where it was measured ------------------------------------

def _figure(pattern: str) -> str:
    found = re.search(pattern, " ".join(README.read_text().split()))  # prose wraps anywhere
    assert found, f"README.md no longer says {pattern!r}"
    return found.group(1)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_readme_test_time_follows_from_its_ci_measurement():
    """The suite's time is the stated test count at the rate CI measured (within 25%): a README
    that raises the count without the time, or states a time its measurement does not give, fails."""
    tests, minutes = _figure(r"The suite \(about ([\d,]+) tests\)"), _figure(r"tests\) takes about (\d+) minutes")
    measured_tests, measured_s = (_figure(r"measured \(([\d,]+) tests in"),
                                  _figure(r"tests in (\d+) s of tests"))
    rate = _number(measured_s) / _number(measured_tests)
    assert f"{rate:.2f} s a test" in " ".join(README.read_text().split())
    predicted_minutes = _number(tests) * rate / 60
    assert 0.8 <= _number(minutes) / predicted_minutes <= 1.25, (minutes, predicted_minutes)


def test_readme_test_count_is_the_suites(request):
    """Run as `make test` runs the suite (all of tests/, not slow), the README's test count is within
    15% of what was collected; any narrower run cannot tell, and skips."""
    config = request.config
    whole = ([Path(a).resolve() for a in config.args] == [ROOT / "tests"]
             and config.option.markexpr == "not slow" and not config.option.keyword)
    if not whole:
        import pytest
        pytest.skip("only a run of the whole suite as `make test` runs it knows the suite's size")
    stated = _number(_figure(r"The suite \(about ([\d,]+) tests\)"))
    assert 0.85 <= len(request.session.items) / stated <= 1.15, (len(request.session.items), stated)


def test_readme_quick_bench_time_is_the_saved_runs():
    """The `--quick` time the README states is the median of the saved quiet `--quick` runs of the
    default preset, with today's scenarios, on a 2-CPU machine (bench/results/*/report.json:
    meta.duration_s), within 15%."""
    from mmserve.bench import PARAMS
    from mmserve.bench.report import _busy_load

    stated = _number(_figure(r"\*\*`--quick` takes about 4 minutes on a quiet 2-core machine\*\* \((\d+) s of"))
    runs = []
    for report in sorted((ROOT / "bench" / "results").glob("*/report.json")):
        meta = json.loads(report.read_text())["meta"]
        params = meta.get("params") or {}
        if (params.get("name") == "quick" and meta.get("preset") == "bench" and meta.get("device", "cpu") == "cpu"
                and meta.get("cpu_count") == 2 and tuple(params.get("scenarios", ())) == PARAMS["quick"].scenarios
                and _busy_load(meta) is None):
            runs.append(meta["duration_s"])
    assert len(runs) >= 3, runs
    median = sorted(runs)[len(runs) // 2]
    assert 0.85 <= stated / median <= 1.15, (stated, median, runs)
    assert 180 <= stated <= 300, "then 'about 4 minutes' is no longer true"


def test_make_says_what_it_installs_before_each_long_step(tmp_path):
    """pip runs --quiet: a fresh `make serve` / `make test` printed nothing for over a minute. Each
    install step (a recipe, ended by touching its stamp) that runs pip says first what it does: going
    back from every pip line, an echo comes before the previous step's `touch` (make -n: a dry run,
    nothing installed)."""
    for target in ("serve", "test"):
        plan = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", target], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.splitlines()
        pips = [i for i, line in enumerate(plan) if "pip install" in line]
        assert len(pips) >= 3, plan  # pip itself, torch, mmserve (and the dev extra for test)
        for at in pips:
            step = [line.split()[0] for line in reversed(plan[:at]) if line.split()[0] in ("echo", "touch")]
            assert step and step[0] == "echo", (target, plan[:at + 1])
