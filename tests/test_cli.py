"""The command line: plain help, a version, one-line errors (exit code 2) naming the file."""

import pytest

from qlsd_flwr import __version__
from qlsd_flwr.cli import main


def test_help_is_plain_and_names_a_file_that_exists(capsys):
    from pathlib import Path

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out
    assert "conf/gaussian_qlsdpp_ray.toml" in out
    assert (Path(__file__).resolve().parents[1] / "conf" / "gaussian_qlsdpp_ray.toml").is_file()


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"qlsd-flwr {__version__}"


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_config_files_are_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert "nope.toml: not found" in _one_line_error(capsys, ["run", "--config", str(missing)])
    assert "is a folder" in _one_line_error(capsys, ["run", "--config", str(tmp_path)])
    bad = tmp_path / "bad.toml"
    bad.write_text("gamma = = 1\n")
    assert "bad.toml: TOML syntax error" in _one_line_error(capsys, ["run", "--config", str(bad)])
    typo = tmp_path / "typo.toml"
    typo.write_text('gama = 0.1\n')
    assert "did you mean gamma" in _one_line_error(capsys, ["run", "--config", str(typo)])


def test_plot_of_a_folder_that_is_no_run(tmp_path, capsys):
    assert "is not a run folder" in _one_line_error(capsys, ["plot", str(tmp_path / "missing")])


def test_an_output_folder_that_cannot_be_made(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the output folder's parent should be
    err = _one_line_error(capsys, ["run", "--set", "engine=local", "--set", "num-rounds=2", "--set", "burn-in=0",
                                   "--set", f"output-dir={blocker}/out", "--set", "progress=false"])
    assert "cannot write or read" in err and "file" in err


def test_a_run_away_chain_is_one_line_and_exit_code_1(tmp_path, capsys):
    # p = 1e-3 (tests/test_influence.py): one reply weighted 1000 throws θ away within 3,000 rounds
    sets = {"task": "gaussian", "p": "0.001", "num-rounds": 3000, "burn-in": 1000, "engine": "local",
            "progress": "false", "plot": "false", "output-dir": str(tmp_path), "run-name": "away"}
    assert main(["run", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("qlsd-flwr: the chain diverged at round")
    assert (tmp_path / "away" / "summary.json").is_file()  # the rounds so far are kept


def test_a_taken_run_name_is_refused_before_the_preparation(tmp_path, capsys, monkeypatch):
    """A run-name whose folder exists is one line naming it and ``resume``, before any exchange: the
    preparation (θ*, the metric, ``gamma = auto``) is never started (here it would raise)."""
    from qlsd_flwr.protocol import precondition

    def never(*a, **k):
        raise AssertionError("the preparation started")

    monkeypatch.setattr(precondition, "prepare", never)
    (tmp_path / "taken").mkdir()
    err = _one_line_error(capsys, ["run", "--set", "engine=local", "--set", "gamma=auto", "--set", "metric=diagonal",
                                   "--set", f"output-dir={tmp_path}", "--set", "run-name=taken",
                                   "--set", "progress=false"])
    assert "run-name:" in err and "taken already exists" in err and "resume =" in err


def test_a_stop_in_the_preparation_says_that_no_run_folder_was_made(tmp_path, capsys, monkeypatch):
    """A stop before the run begins writing (here in the preparation, as a signal there raises) is exit code 143
    and a line that says no folder was made, not that one holds the draws so far."""
    from qlsd_flwr.cli import main
    from qlsd_flwr.protocol import precondition

    def stopped(*a, **k):
        raise KeyboardInterrupt("SIGTERM")  # what the CLI's handler raises

    monkeypatch.setattr(precondition, "prepare", stopped)
    assert main(["run", "--set", "engine=local", "--set", "gamma=auto", "--set", "metric=diagonal",
                 "--set", f"output-dir={tmp_path}", "--set", "progress=false"]) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM before the run began writing" in err and "no run folder was made" in err
    assert not list(tmp_path.iterdir())


def test_flower_s_actor_teardown_errors_are_dropped_from_a_stop_until_the_next_run():
    """Flower's simulation workers log an ERROR with a traceback for each message in flight when a stop tears
    their Ray actors down (seen by timing in the SIGTERM test): from a stop's request until the next run starts
    those records are dropped; any other error (closing the outputs failed) and the next run's still show."""
    import logging

    from qlsd_flwr.flower import logs, stopping

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    died = "The actor died unexpectedly before finishing this task."
    flwr_log, keep, level = logging.getLogger("flwr"), Keep(), logging.getLogger("flwr").level
    flwr_log.addHandler(keep)
    flwr_log.setLevel(logging.INFO)  # other tests quiet Flower's logger
    try:
        with stopping.Stopper() as run:
            flwr_log.error(died)
            run.request("SIGTERM")
            flwr_log.error("An exception was raised when processing a message by RayBackend")
            flwr_log.error(RuntimeError(died))
            flwr_log.error("Traceback (most recent call last): ... ray.exceptions.ActorDiedError: ...")
            flwr_log.error("ServerApp thread raised an exception: OSError: [Errno 28] No space left on device")
        flwr_log.error(died + " (after the run, before the next)")
        with stopping.Stopper():
            flwr_log.error(died + " (the next run's)")
    finally:
        flwr_log.removeHandler(keep)
        flwr_log.setLevel(level)
        logs.quiet_errors(False)
    assert seen == [died, "ServerApp thread raised an exception: OSError: [Errno 28] No space left on device",
                    died + " (the next run's)"]
