"""pbr takes the version from git: clones (shallow ones too) and exported trees install."""

from __future__ import annotations

import pathlib
import re
import subprocess
import zipfile

import pytest

from tests.unit import wheel_build

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETUP_SH = ROOT / "tools" / "setup.sh"


def _git(*args: str, cwd: pathlib.Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def _wheel(
    tree: pathlib.Path, out: pathlib.Path, env: dict[str, str] | None = None
) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel_build.build(tree, out, env))


def _version(wheel: zipfile.ZipFile) -> str:
    return re.sub(r"^flexmig-([^-]+)-.*", r"\1", pathlib.Path(wheel.filename or "").name)


@pytest.fixture(scope="module")
def committed() -> str:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    return _git("rev-parse", "HEAD").strip()


def test_a_shallow_clone_builds_with_a_version_from_git(
    committed: str, tmp_path: pathlib.Path
) -> None:
    clone = tmp_path / "clone"
    _git("clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone), cwd=tmp_path)
    _git("checkout", "-q", committed, cwd=clone)  # the worktree's commit, not main's
    wheel = _wheel(clone, tmp_path / "dist")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", _version(wheel)), _version(wheel)
    names = wheel.namelist()
    # Nova 34 loads compute_driver = flexmig.FlexMigLibvirtDriver as nova.virt.flexmig.
    assert "nova/virt/flexmig/__init__.py" in names
    assert "flexmig/__init__.py" in names and "agents/agent/api.py" in names


def test_a_tree_without_git_history_gets_the_setup_version(tmp_path: pathlib.Path) -> None:
    """What tools/setup.sh does for an exported tree: PBR_VERSION, else pbr refuses."""
    tree = tmp_path / "export"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    unversioned = re.search(r"^UNVERSIONED=(\S+)$", SETUP_SH.read_text(), re.MULTILINE)
    assert unversioned, "tools/setup.sh no longer names the version for trees without git"
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _wheel(tree, tmp_path / "refused", env={"PATH": "/usr/bin:/bin", "GIT_DIR": "/nonexistent"})
    assert b"Versioning for this project requires" in refused.value.stderr
    env = {"PATH": "/usr/bin:/bin", "PBR_VERSION": unversioned.group(1)}
    wheel = _wheel(tree, tmp_path / "dist", env=env)
    assert _version(wheel) == unversioned.group(1)
