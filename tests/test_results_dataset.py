"""``results/`` is a dataset: every study folder has a README.md and a
manifest.json whose records give the command, the commit and the
environment of each committed file, and the text that points into
``results/`` (the README, the docs, the results' READMEs, the notebooks,
the library's comments and docstrings) names no file that does not exist."""
import ast
import io
import json
import re
import tokenize
import subprocess
from itertools import product
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
STUDIES = sorted(p for p in RESULTS.iterdir() if p.is_dir())
HEX40 = re.compile(r"[0-9a-f]{40}")


def manifest(study: Path) -> dict:
    return json.loads((study / "manifest.json").read_text())


def tracked(folder: Path) -> list:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", str(folder.relative_to(REPO))], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.split("\0") if f and (REPO / f).exists()]


def test_there_are_studies():
    assert {"main", "sweeps", "direct"} <= {p.name for p in STUDIES}


@pytest.mark.parametrize("study", STUDIES, ids=[p.name for p in STUDIES])
def test_every_study_has_a_readme_and_a_manifest_of_command_commit_environment(study):
    assert (study / "README.md").is_file(), f"results/{study.name}/ has no README.md (what it holds, each file's command)"
    assert (study / "manifest.json").is_file(), (
        f"results/{study.name}/ has no manifest.json: a list of records, each with files, command, commit and "
        f"environment (see results/balance/manifest.json)")
    m = manifest(study)
    assert m["records"], f"{study.name}: the manifest lists no records"
    for rec in m["records"]:
        files, command = rec["files"], rec["command"]
        assert files and all(isinstance(f, str) for f in files), rec
        commands = [command] if isinstance(command, str) else command
        assert commands and all(isinstance(c, str) and c.strip() for c in commands), rec
        assert HEX40.fullmatch(rec["commit"]), rec
        assert rec["environment"], rec
        for f in files:
            assert (study / f).is_dir() if f.endswith("/") else (study / f).is_file(), f"{study.name}: no {f}"


def _described(path: Path, study: Path, listed: set) -> bool:
    """A file is described by its study's manifest (by name, or under a
    folder it names), or by a manifest of its own: the sweep runner's
    ``<name>.manifest.json`` beside its records, a run folder's manifest.json."""
    rel = path.relative_to(study).as_posix()
    if rel in ("README.md", "manifest.json") or rel in listed:
        return True
    if any(f.endswith("/") and rel.startswith(f) for f in listed):
        return True
    if path.name.endswith(".manifest.json"):
        return path.with_name(path.name[:-len(".manifest.json")] + ".jsonl").exists()
    if path.with_name(path.stem + ".manifest.json").exists():
        return True
    return path.parent != study and (path.parent / "manifest.json").is_file()


@pytest.mark.parametrize("study", STUDIES, ids=[p.name for p in STUDIES])
def test_every_committed_results_file_is_described(study):
    listed = {f for rec in manifest(study)["records"] for f in rec["files"]}
    loose = [p.relative_to(REPO).as_posix() for p in tracked(study) if not _described(p, study, listed)]
    assert not loose, (f"list these in results/{study.name}/manifest.json with their command, commit and "
                       f"environment (or remove what nothing reads): {loose}")


def test_the_manifests_commits_are_in_the_history():
    commits = set()
    for study in STUDIES:
        for rec in manifest(study)["records"]:
            commits |= {rec[k] for k in ("commit", "measured_on", "committed_in") if k in rec}
    try:
        out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, input="\n".join(sorted(commits)) + "\n",
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    missing = [line.split()[0] for line in out.splitlines() if line.endswith("missing")]
    assert not missing, missing


def _expand(pattern: str) -> list:
    """``a_{1,2}.json`` -> ``a_1.json``, ``a_2.json``."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in product(*choices)]


def results_paths_named_in(text: str) -> set:
    """Every ``results/...`` path a text names, less placeholders
    (``results/<study>/``, ``results/sweeps/{study}.jsonl``)."""
    found = set()
    for m in re.finditer(r"(?<![\w/.-])results/[\w.*?{},/-]*", text):
        path = m.group(0).rstrip(".,;:-")
        if re.search(r"\{[^,{}]*\}", path) or path.count("{") != path.count("}"):
            continue
        found.add(path)
    return found


def _texts():
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*/README.md"))]
    for p in paths:
        yield p, p.read_text()
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        yield nb, "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"])


def test_no_text_names_a_results_file_that_does_not_exist():
    missing = []
    for path, text in _texts():
        for named in sorted(results_paths_named_in(text)):
            if not any(list(REPO.glob(p)) if any(ch in p for ch in "*?") else (REPO / p).exists()
                       for p in _expand(named)):
                missing.append(f"{path.relative_to(REPO)}: {named}")
    assert not missing, missing


def comments_and_docstrings(path: Path) -> str:
    """The comments and docstrings of a Python or CUDA source, less the
    files a usage line writes (``--out results/...``)."""
    src = path.read_text()
    if path.suffix == ".py":
        parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                 if tok.type == tokenize.COMMENT]
        parts += [ast.get_docstring(node, clean=False) or "" for node in ast.walk(ast.parse(src))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    else:
        parts = re.findall(r"//[^\n]*|/\*.*?\*/", src, flags=re.S)
    return re.sub(r"(--out|--to)\s+results/", r"\1 OUT/", "\n".join(parts))


# (file, path) pairs a comment names that are not checked here
def test_no_comment_or_docstring_names_a_results_file_that_does_not_exist():
    sources = sorted((REPO / "cupyep").rglob("*.py")) + sorted(p for p in (REPO / "cuda_src").rglob("*")
                                                               if p.suffix in (".cu", ".cuh"))
    missing = []
    for path in sources:
        rel = path.relative_to(REPO).as_posix()
        for named in sorted(results_paths_named_in(comments_and_docstrings(path))):
            if not any(
                    list(REPO.glob(p)) if any(ch in p for ch in "*?") else (REPO / p).exists()
                    for p in _expand(named)):
                missing.append(f"{rel}: {named}")
    assert not missing, missing


def test_results_paths_named_in_finds_paths_and_skips_placeholders():
    text = ("`results/main/*` and results/host_path/notify_{2,4,8}ranks.jsonl, results/sweeps/{study}.jsonl, "
            "results/<study>/README.md; not myresults/x.json")
    assert results_paths_named_in(text) == {"results/main/*", "results/host_path/notify_{2,4,8}ranks.jsonl",
                                            "results/"}
    assert _expand("a_{1,2}_{x,y}.json") == ["a_1_x.json", "a_1_y.json", "a_2_x.json", "a_2_y.json"]
