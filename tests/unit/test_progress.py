"""The CLI's progress line: plain lines off a terminal, at most one a second."""

from __future__ import annotations

import io

from flexmig.progress import MigrationProgress

MIB = 2**20


def test_progress_off_a_terminal_is_plain_lines_with_the_jobs_numbers():
    out = io.StringIO()
    bar = MigrationProgress("vm0 A->B", stream=out, width=10)
    bar(
        {
            "memory_total": 512 * MIB,
            "memory_remaining": 128 * MIB,
            "memory_processed": 400 * MIB,
            "memory_iteration": 3,
        }
    )
    bar({"memory_total": 512 * MIB, "memory_remaining": 0, "memory_processed": 500 * MIB})
    bar.note("switched to postcopy after round 2")
    bar.finish()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("vm0 A->B [#######---]  75%  sent   400.0 MiB  round  3")
    assert len(lines) == 2  # the second update came within the same second
    assert lines[1] == "  * switched to postcopy after round 2"
    assert "\r" not in out.getvalue()


def test_an_empty_job_is_zero_percent_not_an_error():
    out = io.StringIO()
    MigrationProgress("x", stream=out)({})
    assert "  0%" in out.getvalue()
