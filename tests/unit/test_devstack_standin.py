"""The DevStack stand-in against DevStack's own functions, where a DevStack checkout is at hand.

The plugin's tests are only as good as ``tests/devstack_standin/functions`` is
faithful.  With FLEXMIG_DEVSTACK_DIR pointing at a DevStack checkout, the same
script of ini and service operations runs once on DevStack's ``functions-common``
and ``inc/ini-config`` and once on the stand-in; files and output must be equal.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parents[1] / "devstack_standin" / "functions"
DEVSTACK = os.environ.get("FLEXMIG_DEVSTACK_DIR", "")

OPERATIONS = r"""
f=$WORK/a.conf
iniset $f DEFAULT foo bar
iniset $f DEFAULT foo "baz   qux"
iniset $f sec1 opt1 'v&1\x'
iniset $f sec1 opt2 two
printf '\n[sec2]\nopt3   =   old\nother=1\n' >>$f
iniset $f sec2 opt3 new
iniset -sudo $f sec3 x y
inidelete $f sec2 other
iniset $f sec z 1
iniset $f sec2 '' ignored
echo "get:[$(iniget $f sec2 opt3)] [$(iniget $f DEFAULT foo)] [$(iniget $f sec1 nope)]"
if ini_has_option $f sec1 opt2; then echo has-opt2; fi
if ! ini_has_option $f sec1 nope; then echo no-nope; fi
iniset $WORK/new.conf agent port 9797
ENABLED_SERVICES=a,n-cpu
DISABLED_SERVICES=
enable_service x >/dev/null
disable_service a
enable_service a >/dev/null
if is_service_enabled q y x; then echo x-enabled; fi
if ! is_service_enabled a; then echo a-disabled; fi
echo "services:[$ENABLED_SERVICES]"
for v in yes No 1 0 TRUE false maybe ""; do X=$v; echo -n "$(trueorfalse Dflt X) "; done
echo
"""

REAL_PRELUDE = """
TOP_DIR=$DEVSTACK
source "$DEVSTACK/functions-common"
source "$DEVSTACK/inc/ini-config"
function sudo { "$@"; }
"""
STANDIN_PRELUDE = 'source "$STANDIN"\n'


def run(prelude: str, work: Path) -> tuple[str, dict[str, str]]:
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(work),
        "WORK": str(work),
        "DEVSTACK": DEVSTACK,
        "STANDIN": str(STANDIN),
        "STANDIN_LOG": str(work.parent / f"{work.name}.log"),
    }
    proc = subprocess.run(
        ["bash", "-c", prelude + OPERATIONS],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout, {p.name: p.read_text() for p in sorted(work.iterdir())}


@pytest.mark.skipif(
    not (DEVSTACK and Path(DEVSTACK, "inc", "ini-config").is_file()),
    reason="set FLEXMIG_DEVSTACK_DIR to a DevStack checkout to compare the stand-in with it",
)
def test_standin_behaves_as_devstacks_own_functions(tmp_path: Path):
    real_out, real_files = run(REAL_PRELUDE, tmp_path / "real")
    standin_out, standin_files = run(STANDIN_PRELUDE, tmp_path / "standin")
    assert "get:[new] [baz qux] []" in real_out
    assert standin_out == real_out
    assert standin_files == real_files
