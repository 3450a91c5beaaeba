"""The repository's text names nothing outside it: no ``../shared`` path
in the README, the docs, the notebooks, the code or the results' READMEs
(test logs, which record the machine they ran on, aside)."""
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT = (".md", ".py", ".ipynb", ".yml", ".toml", ".cu", ".cuh", ".json", ".txt")


def test_nothing_names_a_path_outside_the_repository():
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    outside = [f for f in files.splitlines()
               if f.endswith(TEXT) and f != "tests/test_docs.py"
               and "../shared" in (REPO / f).read_text(errors="replace")]
    assert not outside, outside


def test_every_relative_link_in_the_docs_resolves():
    import re
    broken = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" not in target and not (md.parent / target).exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert not broken, broken
