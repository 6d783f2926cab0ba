from flexmig_lab import heartbeat


def _beats(times_ms, host="A", first=0):
    return [heartbeat.Beat(int(t * 1e6), host, first + i) for i, t in enumerate(times_ms)]


def test_longest_gap_spans_the_switch_between_hosts():
    beats = _beats([0, 10, 20, 30]) + _beats([330, 340], host="B", first=4)
    report = heartbeat.analyse(beats)
    assert report.longest_gap_ms == 300.0
    assert report.gap_start_ns == 30_000_000
    assert report.hosts == ("A", "B")
    assert report.last_host == "B"
    assert report.beats == 6


def test_window_excludes_beats_outside_it():
    beats = _beats([0, 500, 510, 520])
    assert heartbeat.analyse(beats, since_ns=400_000_000).longest_gap_ms == 10.0
    assert heartbeat.analyse(beats, until_ns=100_000_000).beats == 1


def test_order_follows_the_guest_counter_not_arrival():
    beats = _beats([0, 10, 20])
    beats.reverse()
    assert heartbeat.analyse(beats).longest_gap_ms == 10.0


def test_no_beats():
    report = heartbeat.analyse([])
    assert (report.beats, report.longest_gap_ms, report.last_host) == (0, 0.0, None)


def test_parse_skips_garbage_lines():
    lines = ["100 A 0 5", "junk", "", "200 B 1 6", "x A 2 3"]
    assert heartbeat.parse(lines) == [heartbeat.Beat(100, "A", 0), heartbeat.Beat(200, "B", 1)]
