"""The product's wheel holds none of the lab, and nothing of the lab imports from it.

The wheel is built from a copy of the tree (pip builds in the source
directory, which must stay clean while other runs use it), then unpacked
into a directory that a site-less interpreter imports from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.unit import wheel_build

ROOT = Path(__file__).resolve().parents[2]
# Build outputs and caches that are not the tree's sources.
SKIP = shutil.ignore_patterns(
    ".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=SKIP)
    out = tmp / "dist"
    # The copy has no git history for pbr to take a version from: give it
    # one, as tools/setup.sh does for such a tree (test_packaging.py).
    env = {**os.environ, "PBR_VERSION": "0.0.0"}
    return wheel_build.build(tree, out, env)


def test_the_wheel_holds_the_product_and_no_lab(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"flexmig", "agents", "nova_driver", "ovs_ext", "nova"}
    assert "flexmig/processutil.py" in names
    lab = [n for n in names if "lab" in Path(n).parts[0] or "/lab/" in n or "/guest/" in n]
    assert lab == []
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "flexmig_lab" not in text
    assert "flexmig = flexmig.cli:main" in text


def test_the_lab_cannot_be_imported_from_the_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site processing, so the editable installs of this checkout (.pth
    # files) are not seen; the virtualenv's packages (cliff, oslo, libvirt) are
    # put after the wheel's files as plain path entries.
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    probe = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(site)!r}]\n"
        f"sys.path += {deps!r}\n"
        "import flexmig.processutil, flexmig.cli, flexmig.migrate_cli\n"
        "import agents.agent.host_inventory, ovs_ext.config\n"
        "assert flexmig.__file__.startswith(sys.path[0]), flexmig.__file__\n"
        "for name in ('flexmig_lab', 'flexmig.lab'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(name + ' is importable')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
