"""The guest's dirtier and verify, built and run natively on the host.

These are the same sources the initramfs is built from; here they work on a
private directory instead of the guest's /dev/shm.
"""

import mmap
import os
import shutil
import signal
import subprocess
import time

import pytest

from flexmig_lab import image

PAGE = 4096


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (tools/setup.sh installs it)")
    out = tmp_path_factory.mktemp("guest-bin")
    image._compile_programs(out)
    return out


@pytest.fixture
def workset(programs, tmp_path):
    env = dict(os.environ, FM_WORKSET_DIR=str(tmp_path))
    dirtier = subprocess.Popen(
        [programs / "dirtier", "4", "20000", "random"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert "ready" in dirtier.stdout.readline()
    yield env, tmp_path, dirtier
    dirtier.kill()
    dirtier.wait()


def _verify(programs, env):
    proc = subprocess.run(
        [programs / "verify"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    fields = dict(kv.split("=") for kv in proc.stdout.split()[1:])
    return proc.returncode, fields


def _poke(path, offset, data):
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[offset : offset + len(data)] = data


def test_verify_passes_while_dirtier_rewrites_pages(programs, workset):
    env, _, _ = workset
    time.sleep(0.3)
    rc, first = _verify(programs, env)
    time.sleep(0.3)
    rc2, second = _verify(programs, env)
    assert (rc, rc2) == (0, 0)
    assert first["pages"] == "1024" and first["bad"] == "0" and first["lost"] == "0"
    assert int(second["written"]) > int(first["written"]) > 1024  # it really dirties


def test_verify_counts_corrupted_and_zeroed_pages(programs, workset):
    env, tmp, dirtier = workset
    rc, _ = _verify(programs, env)
    assert rc == 0
    # A dead writer leaves the pages stable; verify must not wait for it.
    dirtier.kill()
    dirtier.wait()
    # The kill can land in the middle of a page write: a page it tore is
    # counted here, so the pokes below are measured against it.
    _, before = _verify(programs, env)
    _poke(tmp / "fm-workset", 3 * PAGE + 100, b"\xff")
    _poke(tmp / "fm-workset", 7 * PAGE, bytes(PAGE))
    rc, fields = _verify(programs, env)
    assert rc == 1
    added = (int(fields["bad"]) - int(before["bad"]), int(fields["lost"]) - int(before["lost"]))
    assert added == (1, 1), (before, fields)


def test_verify_refuses_to_race_a_writer_that_does_not_pause(programs, workset):
    env, _, dirtier = workset
    os.kill(dirtier.pid, signal.SIGSTOP)
    try:
        rc, fields = _verify(programs, env)
    finally:
        os.kill(dirtier.pid, signal.SIGCONT)
    assert rc == 2
    assert fields == {"error": "dirtier-did-not-pause"}


def test_verify_without_a_workset_says_so(programs, tmp_path):
    env = dict(os.environ, FM_WORKSET_DIR=str(tmp_path))
    proc = subprocess.run(
        [programs / "verify"], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "no-workset" in proc.stdout


def _page_versions(meta_path):
    """struct fm_meta: six u32, a u64 count, then one u32 version per page."""
    raw = meta_path.read_bytes()
    npages = int.from_bytes(raw[4:8], "little")
    return [int.from_bytes(raw[32 + 4 * i : 36 + 4 * i], "little") for i in range(npages)]


def test_a_hot_set_is_rewritten_and_the_rest_left_cold(programs, tmp_path):
    env = dict(os.environ, FM_WORKSET_DIR=str(tmp_path))
    dirtier = subprocess.Popen(
        [programs / "dirtier", "4", "20000", "random", "1"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "256 hot" in dirtier.stdout.readline()
        time.sleep(0.5)
        rc, fields = _verify(programs, env)
        versions = _page_versions(tmp_path / "fm-workset.meta")
    finally:
        dirtier.kill()
        dirtier.wait()
    assert rc == 0 and fields["pages"] == "1024"
    assert max(versions[:256]) > 1  # the first MiB is being rewritten
    assert set(versions[256:]) == {1}  # the other 3 MiB were written once


def test_a_hot_set_larger_than_the_working_set_is_refused(programs, tmp_path):
    env = dict(os.environ, FM_WORKSET_DIR=str(tmp_path))
    proc = subprocess.run(
        [programs / "dirtier", "4", "100", "random", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert proc.returncode == 2 and "bad working set" in proc.stderr
