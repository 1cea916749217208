"""The README is a user's guide whose commands are the ones CI runs (issue 33 item 4).

* ``.ci/run`` runs exactly the README's test command, nothing before or after it.
* The README stays a guide: at most 350 lines, no measurement history (that is
  docs/performance.md's), no internal ``Note [...]`` names a user cannot open.
* Nothing in the docs links to a file outside the repository, and no file of the
  repository cites the design or style files that once lived outside it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
pytestmark = pytest.mark.timeout(30)  # the README is in the repository: none is a failure


def _two_commands():
    text = README.read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    return [b.strip() for b in blocks]


def test_ci_runs_exactly_the_readme_test_command():
    main_job, test_command = _two_commands()
    assert "\n" not in test_command and "\n" not in main_job
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci
                if line.strip() and not line.startswith("#")
                and line not in ("set -euo pipefail", 'cd "$(dirname "$0")/.."')]
    assert commands == [test_command]
    # CPU torch before the [torch] extra, which would otherwise fetch a CUDA build.
    assert test_command.index("whl/cpu") < test_command.index('".[test,torch]"')


def test_readme_is_a_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, len(lines)
    text = "\n".join(lines)
    assert "Note [" not in text
    for history in (r"earlier run", r"earlier session", r"late 2026",
                    r"\bfrom [\d.]+ to [\d.]+ ?(us|ms)\b", r"took the median",
                    r", from [\d.]+-[\d.]+\b"):  # "0.74-0.88, from 0.77-0.86": a change told
        assert not re.search(history, text, re.I), history


def _docs():
    yield README
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "csrc").glob("*/README.md"))


def test_doc_links_stay_in_the_repository():
    for doc in _docs():
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if re.match(r"[a-z]+:", target):  # a URL
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), (doc.name, target)


def test_no_file_cites_a_file_outside_the_repository():
    outside = ("ARCHITECTURE" + ".md", "STYLE" + ".md", "STYLE" + " section", "../" + "shared")
    roots = [ROOT / d for d in ("csrc", "python", "tests", "bench", "tools", "docs", ".ci")]
    files = [README, ROOT / "pyproject.toml", ROOT / "CMakeLists.txt"]
    for r in roots:
        files += [p for p in r.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for name in outside:
            assert name not in text, (str(f.relative_to(ROOT)), name)
