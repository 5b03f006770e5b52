"""``qlsd-flwr check [APP_DIR] [--run-config STRING]``: a Flower app's run-config keys named before
``flwr run`` refuses them with only ``[code: 15] Invalid run configuration.`` (docs/CONFIGURATION.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from qlsd_flwr.cli import main
from qlsd_flwr.deploy.appcheck import check_app

REPO = Path(__file__).resolve().parents[1]
OURS = '[tool.flwr.app.components]\nserverapp = "qlsd_flwr.flower.server_app:app"\n' \
       'clientapp = "qlsd_flwr.flower.client_app:app"\n'
YOURS = '[tool.flwr.app.components]\nserverapp = "my_app.server:app"\nclientapp = "my_app.client:app"\n'


def _app(tmp_path: Path, config: str, components: str = OURS) -> Path:
    app = tmp_path / "app"
    app.mkdir(parents=True)
    (app / "pyproject.toml").write_text('[project]\nname = "my-app"\nversion = "1.0.0"\n\n'
                                        f'[tool.flwr.app]\npublisher = "me"\n\n{components}\n'
                                        f"[tool.flwr.app.config]\n{config}")
    return app


def test_a_mistyped_run_config_key_is_named_with_its_did_you_mean(tmp_path):
    app = _app(tmp_path, "num-rounds = 200\nburn-in = 50\ngamma = 0.00049\n")
    proc = subprocess.run([sys.executable, "-m", "qlsd_flwr", "check", str(app), "--run-config", "num-round=300"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("--run-config: num-round: unknown key (did you mean num-rounds")
    assert str(app / "pyproject.toml") in lines[0] and "[code: 15]" in lines[0]
    assert proc.stdout == ""


def test_a_run_config_key_the_app_does_not_declare_is_named(tmp_path):
    app = _app(tmp_path, "num-rounds = 200\nburn-in = 50\n")
    report = check_app(app, ["num-rounds=300 variant='qlsd'"])
    assert report.code == 2
    assert len(report.problems) == 1, report.problems
    line = report.problems[0]
    assert line.startswith("--run-config: variant: not declared in ") and str(app / "pyproject.toml") in line
    assert "did you mean" not in line  # a qlsd-flwr key: declare it, no spelling to fix
    assert check_app(app, ["num-rounds=300"]).code == 0


def test_the_repository_app_and_the_quickstart_pass(capsys):
    assert main(["check", str(REPO)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok: ") and out.count("\n") == 1 and err == "", (out, err)
    report = check_app(REPO / "examples" / "quickstart-torch")
    assert report.code == 0 and not report.problems and not report.warnings, report
    assert report.ok.startswith(f"ok: {REPO / 'examples' / 'quickstart-torch' / 'pyproject.toml'}: ")
    assert "keys declared, all qlsd-flwr keys, values valid" in report.ok
    # every key of the repository's app may be set, by a string or a file of conf/
    assert check_app(REPO, ['num-rounds=50 burn-in=10 variant="qlsd" num-clients=2 s="2,4"']).code == 0
    assert check_app(REPO, [str(REPO / "conf" / "gaussian_qlsdpp_ray.toml")]).code == 0


def test_a_missing_pyproject_or_table_names_the_file(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"{tmp_path / 'pyproject.toml'}: not found" and out == ""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert main(["check", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{tmp_path / 'pyproject.toml'}: no [tool.flwr.app.config] table")
    (tmp_path / "pyproject.toml").write_text("[tool.flwr.app.config\n")
    assert main(["check", str(tmp_path)]) == 2
    assert "pyproject.toml: TOML syntax error" in capsys.readouterr().err


def test_values_are_checked_and_named_by_their_source(tmp_path):
    app = _app(tmp_path, "num-rounds = 200\nburn-in = 50\ngamma = 0.00049\n")
    assert check_app(app, ["gamma=-1"]).problems == ["--run-config: gamma must be a finite number > 0 or 'auto' "
                                                     "(got -1)"]
    # the package's apps: the rules involving several keys too
    assert check_app(app, ["num-rounds=40"]).problems == ["--run-config: burn-in must be in [0, num-rounds) = "
                                                          "[0, 40) (got 50)"]
    bad = _app(tmp_path / "bad", "num-rounds = 4.5\n")
    assert check_app(bad).problems == [f"{bad / 'pyproject.toml'}: num-rounds: expected an integer, got 4.5"]
    # what Flower's parser refuses or drops, by the key or the words
    text = check_app(app, ["gamma=auto"]).problems
    assert len(text) == 1 and text[0].startswith("--run-config: gamma: auto is no TOML value"), text
    dropped = check_app(app, ["num-rounds 300"]).problems
    assert dropped and dropped[0].startswith("--run-config: 'num-rounds 300': not key=value"), dropped


def test_keys_outside_the_table_by_who_reads_them(tmp_path):
    """The rule of docs/CONFIGURATION.md: the package's apps read every declared key (one outside the
    table is a problem); a user's own apps read their own keys (accepted; a warning when close to a key)."""
    config = "num-rounds = 300\nburn-in = 50\nlearning-rate = 0.01\nnum-round = 3\n"
    ours = _app(tmp_path / "ours", config)
    report = check_app(ours)
    assert report.code == 2 and len(report.problems) == 2, report.problems
    assert report.problems[1].startswith(f"{ours / 'pyproject.toml'}: num-round: not a qlsd-flwr key (did you mean "
                                         "num-rounds")
    yours = _app(tmp_path / "yours", config, components=YOURS)
    report = check_app(yours, ["learning-rate=0.1 num-rounds=10"])
    assert report.code == 0 and not report.problems, report.problems
    assert [w.split(": ")[2] for w in report.warnings] == ["num-round"]  # learning-rate: the app's own, silent
    assert "did you mean num-rounds" in report.warnings[0]
    assert "2 the app's own: learning-rate, num-round" in report.ok
    # a typo of the app's own key, not declared: named with it as the did-you-mean
    (typo,) = check_app(yours, ["learning-rat=0.1"]).problems
    assert typo.startswith("--run-config: learning-rat: unknown key (did you mean learning-rate")


def test_the_configuration_page_shows_the_real_output(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", ".", "--run-config", "num-round=300"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"$ qlsd-flwr check . --run-config 'num-round=300'\n{line}\n" in (REPO / "docs" / "CONFIGURATION.md").read_text()
