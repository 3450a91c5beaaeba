"""environment.yml installs what the package needs: every runtime
dependency of pyproject.toml and of the lab extra, and the NVSHMEM library at the version the
nvshmem extra pins (every node needs the same one)."""
import re
import pytest

tomllib = pytest.importorskip("tomllib")
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_conda_environment_has_every_runtime_dependency_and_the_nvshmem_pin():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = (REPO / "environment.yml").read_text().lower().replace("_", "-")
    listed = {_name(line.lstrip(" -")) for line in env.splitlines() if line.strip().startswith("- ")}
    needed = project["dependencies"] + project["optional-dependencies"]["lab"]
    missing = {_name(r) for r in needed} - listed
    assert not missing, f"environment.yml lacks {sorted(missing)}"
    pin = next(r for r in project["optional-dependencies"]["nvshmem"] if r.startswith("nvidia-nvshmem"))
    assert pin.replace("_", "-").lower() in env, f"environment.yml must pin {pin}"
