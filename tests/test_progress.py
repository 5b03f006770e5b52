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
