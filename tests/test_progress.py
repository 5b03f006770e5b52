"""Progress display: a bar in a terminal, readable one-line summaries in a log."""

import io

from qlsd_flwr.outputs.progress import progress_bar


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_whole_lines_not_a_redrawn_bar():
    out = io.StringIO()  # not a terminal: what `flwr log` or a CI log sees
    bar = progress_bar(400, True, "qlsd-pp flower-ray", stream=out, interval=0.0)
    for _ in range(400):
        bar.update(1)
    bar.set_postfix({"chain-it/s": "1,000"})
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 400  # interval 0: one line per update, none repeated at close
    assert lines[-1].startswith("qlsd-pp flower-ray: 400/400 rounds (100 %), ")
    assert lines[0].startswith("qlsd-pp flower-ray: 1/400 rounds (0 %), ")


def test_lines_are_rate_limited_but_the_end_is_always_written():
    out = io.StringIO()
    bar = progress_bar(50, True, "x", stream=out, interval=3600.0)
    for _ in range(30):
        bar.update(1)
    bar.close()  # stopped early (an error, a stop): the last state is still written
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
    assert out.getvalue().startswith("x: 30/50 rounds (60 %)")


def test_a_terminal_gets_the_bar_and_off_means_silent():
    tty = _Tty()
    bar = progress_bar(10, True, "y", stream=tty)
    bar.update(10)
    bar.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()
    quiet = io.StringIO()
    bar = progress_bar(10, False, "z", stream=quiet)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""


def test_under_flwr_run_progress_announcements_and_warnings_go_to_flowers_log():
    """The ``flwr run`` app sends its lines through Flower's logger (whose uploader a deployment's
    ``flwr log`` reads), whatever level ``quiet_flower`` set, and not to standard error twice."""
    import logging

    from qlsd_flwr.flower.server_app import ToFlowerLog, log_into_flower, quiet_flower
    from qlsd_flwr.outputs.progress import announce, progress_bar, set_sink

    got: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append((record.levelno, record.getMessage()))

    flwr_log, ours = logging.getLogger("flwr"), logging.getLogger("qlsd_flwr")
    keep = Keep()
    flwr_log.addHandler(keep)
    try:
        log_into_flower()
        quiet_flower(False)  # Flower's own INFO records are dropped; ours are not
        announce("qlsd-pp: writing /x", True)
        bar = progress_bar(3, True, "qlsd-pp flower", interval=0.0)
        bar.update(3)
        ours.warning("convergence: NOT MIXED")
        flwr_log.info("Flower's own round log")
        assert (logging.INFO, "qlsd-pp: writing /x") in got
        assert any(m.startswith("qlsd-pp flower: 3/3 rounds (100 %)") for _, m in got)
        assert (logging.WARNING, "convergence: NOT MIXED") in got
        assert all("Flower's own" not in m for _, m in got)
    finally:
        set_sink(None)
        flwr_log.removeHandler(keep)
        for h in [h for h in ours.handlers if isinstance(h, ToFlowerLog)]:
            ours.removeHandler(h)
        ours.propagate = True
