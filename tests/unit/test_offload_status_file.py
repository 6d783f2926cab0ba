"""The status file is written by the poller and the control interface at once."""

import json
import threading

from ovs_ext import app


def test_writers_in_several_threads_never_take_each_others_file(tmp_path):
    path = str(tmp_path / "offload-status.json")
    errors = []

    def write(n):
        try:
            for i in range(200):
                app.write_status(path, {"writer": n, "i": i, "flows": list(range(50))})
        except OSError as exc:  # FileNotFoundError: a rename took another's file
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert json.loads((tmp_path / "offload-status.json").read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["offload-status.json"]
