"""Every oslo.config namespace has a generated sample, and every sample is current."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATOR_CONFS = sorted((ROOT / "etc" / "flexmig").glob("*-config-generator.conf"))


def _values(path: pathlib.Path, key: str) -> list[str]:
    """A generator file's values for ``key`` (oslo-config-generator repeats "namespace")."""
    return re.findall(rf"^{key}\s*=\s*(\S+)\s*$", path.read_text(), re.MULTILINE)


@pytest.mark.parametrize("generator", GENERATOR_CONFS, ids=lambda p: p.name)
def test_committed_sample_is_what_the_generator_makes(
    generator: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    (output,) = _values(generator, "output_file")
    sample = ROOT / output
    out = tmp_path / "sample.conf"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "oslo_config.generator",
            "--config-file",
            str(generator),
            "--output-file",
            str(out),
        ],
        check=True,
        cwd=ROOT,
    )
    assert (
        out.read_text() == sample.read_text()
    ), f"{sample.relative_to(ROOT)} is stale: regenerate it with tox -e genconfig"


def test_every_flexmig_namespace_has_a_sample() -> None:
    declared = {
        ep.name
        for ep in importlib.metadata.entry_points(group="oslo.config.opts")
        if ep.name.startswith("flexmig.")
    }
    covered = {ns for path in GENERATOR_CONFS for ns in _values(path, "namespace")}
    assert declared, "no flexmig.* oslo.config.opts entry points: is FlexMig installed?"
    assert declared <= covered, f"no sample generated for {sorted(declared - covered)}"
