"""What movers leave in the agent's state directory, on every path out."""

import os
import subprocess
import sys
import time

import pytest

from agents.agent import mover_files


def _mover_files(state, pair, role="send", log="output", stats=False):
    base = state / f"mover-{pair}-{role}"
    for suffix in (".token", ".ready"):
        base.with_suffix(suffix).write_text("x")
    base.with_suffix(".log").write_text(log)
    if stats:
        base.with_suffix(".stats").write_text("{}")
    return base


@pytest.fixture
def fake_mover(tmp_path):
    """A running process whose command line names a mover's token file, as
    the real mover's does (a previous agent's orphan)."""
    started = []

    def start(base):
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        proc = subprocess.Popen([*argv, "--token-file", str(base.with_suffix(".token"))])
        started.append(proc)
        deadline = time.monotonic() + 10
        while base not in mover_files.live_movers(base.parent):
            assert time.monotonic() < deadline, "fake mover not seen in /proc"
            time.sleep(0.02)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_mover_that_ended_well_leaves_nothing(tmp_path):
    base = _mover_files(tmp_path, "abc123", stats=True)
    assert mover_files.retire(base, ok=True) is None
    assert list(tmp_path.iterdir()) == []


def test_a_failed_mover_leaves_only_its_log_marked_failed(tmp_path):
    base = _mover_files(tmp_path, "abc123", log="connection refused", stats=True)
    kept = mover_files.retire(base, ok=False)
    assert [p.name for p in tmp_path.iterdir()] == ["mover-abc123-send.failed.log"]
    assert kept.read_text() == "connection refused"
    assert mover_files.base_of(kept) is None  # a kept log is no mover's live file


def test_only_the_newest_failed_logs_are_kept(tmp_path):
    for n in range(5):
        base = _mover_files(tmp_path, f"abc12{n}")
        mover_files.retire(base, ok=False, keep=3)
        os.utime(mover_files.failed_log(base), (1000 + n, 1000 + n))
    mover_files.prune_failed_logs(tmp_path, keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"mover-abc12{n}-send.failed.log" for n in (2, 3, 4)]


def test_a_restarted_agent_retires_what_its_predecessor_left(tmp_path, fake_mover):
    dead = _mover_files(tmp_path, "dead01", log="killed mid-stream")
    done = _mover_files(tmp_path, "done01", role="recv", stats=True)
    live = _mover_files(tmp_path, "live01")
    (tmp_path / "mig-dead01.sock").write_text("")
    (tmp_path / "mig-live01.sock").write_text("")
    proc = fake_mover(live)

    orphans = mover_files.sweep(tmp_path)

    assert [(o.base, o.pid) for o in orphans] == [(live, proc.pid)]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([
        mover_files.failed_log(dead).name,  # no stats: it did not end well
        "mig-live01.sock", *(live.with_suffix(s).name for s in (".log", ".ready", ".token")),
    ])  # fmt: skip
    assert not list(tmp_path.glob(f"{done.name}*"))


def test_orphans_are_retired_when_they_end_and_killed_when_stuck(tmp_path, fake_mover):
    ends = _mover_files(tmp_path, "ends01")
    stuck = _mover_files(tmp_path, "stuck1", role="recv")
    (tmp_path / "mig-ends01.sock").write_text("")
    first, second = fake_mover(ends), fake_mover(stuck)
    orphans = mover_files.Orphans(mover_files.sweep(tmp_path), max_age_s=30)
    assert len(orphans.reap()) == 2  # both still run: nothing touched
    assert ends.with_suffix(".token").exists()

    first.kill()
    first.wait()
    assert [o.base for o in orphans.reap()] == [stuck]
    assert not (tmp_path / "mig-ends01.sock").exists()
    assert mover_files.failed_log(ends).exists() and not ends.with_suffix(".token").exists()

    orphans.reap(now=time.monotonic() + 31)  # past max_age_s: killed as stuck
    assert second.wait(5) == -9
    assert orphans.reap() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        mover_files.failed_log(b).name for b in (ends, stuck)
    )
