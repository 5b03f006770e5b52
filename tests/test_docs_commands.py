"""Every command the documentation tells a user to run, run (or, where it takes minutes or a
cluster, checked) by a test.

The commands are read from the README, ``docs/*.md`` and ``benchmarks/RESULTS.md``: each line of
a fenced ``bash`` block, and each inline code span that starts with one of our programs. Each is
then handled by what it is (``./dev test`` is the suite itself, which CI runs):

* ``./dev run run …``, ``qlsd-flwr run …``, ``./dev demo --toy``: run through the CLI on a small
  budget (``num-rounds`` 4, the Ray engine swapped for the in-process one: the Ray engine has its
  own tests), in a scratch working directory so that relative paths (``outputs/…``,
  ``conf/…``) mean what they say; ``./dev run plot outputs/<run>`` on the run just made; ``resume``
  and ``./dev demo`` (the main job, 5 minutes) have their configuration resolved, and are run
  whole by ``tests/test_hardening.py`` and ``.ci`` respectively.
* ``python -m qlsd_flwr.deploy …``: run, paths redirected into a scratch folder (``ray-state``,
  which needs a Ray cluster: its arguments parsed; the cluster test runs it in
  ``tests/test_deployment.py``).
* ``python benchmarks/….py``, ``simulations/….py`` (minutes to hours in full): the script exists,
  every option the docs give appears in its ``--help``, and the command runs whole at a smoke size
  (``QLSD_SMOKE``, :mod:`benchmarks.smoke`: the same code on a few rounds and draws, Ray swapped for
  the in-process engine, its results written to a scratch folder instead of over the recorded ones).
* Flower's and Ray's own programs (``flwr``, ``flower-superlink``, ``flower-supernode``, ``ray``)
  are run in ``tests/test_flwr_run.py`` and ``tests/test_deployment.py`` in the forms the docs give;
  system tools (``git``, ``openssl``, ``ssh-keygen``, a venv, ``cd``, ``export``) are not ours.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qlsd_flwr import cli
from qlsd_flwr.config import resolve

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
OURS = ("./dev ", "qlsd-flwr ", "python benchmarks/", "python simulations/", ".venv/bin/python simulations/",
        ".venv/bin/python benchmarks/", "python -m qlsd_flwr", "PYTHONPATH=", "QLSD_RAY_ADDRESS=")
THEIRS = ("flwr ", "flower-superlink", "flower-supernode", "ray ", "git ", "openssl ", "ssh-keygen ", "python3 -m venv",
          "source ", "export ", "cd ", "printf ", "pip ", "kill ", "pkill ", "lsof ")
BUDGET = {"num-rounds": 4, "burn-in": 0, "thin": 1, "progress": False, "plot": False, "loo": "off"}


def commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every documented command line of ours (comments stripped)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        lines = []
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
            lines += block.replace("\\\n", " ").split("\n")
        # inline code, also where the text wraps a command over two lines (not across a paragraph)
        lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
                  if "\n\n" not in span]
        for line in lines:
            line = re.sub(r"\s+#.*$", "", line.strip())
            if line.startswith(OURS):
                out.append((doc.relative_to(REPO).as_posix(), " ".join(line.split())))
    return sorted(set(out))


def _argv(cmd: str) -> tuple[dict, list[str]]:
    """Environment prefixes (``K=V``) and the argument list."""
    words = shlex.split(cmd)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def test_the_docs_name_commands_and_only_known_programs():
    found = commands()
    assert len(found) > 30, found  # the reader works
    for doc in DOCS:  # every fenced command line is ours or a known program's
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").split("\n"):
                line = line.strip()
                if line and not line.startswith("#"):
                    assert line.startswith(OURS + THEIRS), (doc.name, line)


def _cli_lines():
    """The CLI's commands, each once (the first document that gives it)."""
    seen, out = set(), []
    for w, c in commands():
        words = _argv(c)[1]
        if (words[:1] == ["qlsd-flwr"] or words[:2] in (["./dev", "run"], ["./dev", "demo"])) and c not in seen:
            seen.add(c)
            out.append((w, c))
    return out


def _as_cli(words: list[str]) -> list[str]:
    """``./dev run <args>`` and ``qlsd-flwr <args>`` are both ``qlsd_flwr.cli.main(<args>)``."""
    return words[2:] if words[0] == "./dev" and words[1] == "run" else words[1:]


def test_every_documented_cli_command_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").symlink_to(REPO / "conf")
    runs = []
    plots = []
    for where, cmd in _cli_lines():
        env, words = _argv(cmd)
        if "..." in cmd or "…" in cmd:  # an elided command in prose: its full form is listed elsewhere
            continue
        if words[0] == "./dev" and words[1] == "demo":
            args = cli.parse_sets([w for w in words[2:] if not w.startswith("--")])
            if "--toy" in words:  # the toy demo on a small budget, in process (Ray: the engines' tests)
                budget = {**BUDGET, "engine": "inprocess", "run-name": "toy"}
                assert cli.main(["demo", "--toy", *(f"{k}={v}" for k, v in {**args, **budget}.items())]) == 0, cmd
            else:  # the main job: its keys resolve (CI runs the whole job from a fresh clone)
                from qlsd_flwr.experiments.mainjob import QLSD_MAIN

                resolve({**QLSD_MAIN, **{k: v for k, v in args.items() if not k.startswith("fedavg-")}})
            continue
        argv = _as_cli(words)
        if "--help" in argv:
            with pytest.raises(SystemExit) as exc:
                cli.main(argv)
            assert exc.value.code == 0, (where, cmd)
        elif argv[0] == "plot":  # after the runs (below)
            plots.append((where, cmd))
        elif argv[0] == "run":
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            if "PYTHONPATH" in env:
                monkeypatch.syspath_prepend(str(REPO / env["PYTHONPATH"]))
            sets = cli.parse_sets([argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
            conf = argv[argv.index("--config") + 1] if "--config" in argv else None
            base = cli.load_config_file(conf) if conf else {}
            if "resume" in sets:  # needs a stopped run: resolved here, run in tests/test_hardening.py
                continue
            if "QLSD_RAY_ADDRESS" in env:  # a Ray cluster: resolved here, run in tests/test_deployment.py
                resolve({**base, **sets})
                continue
            if "<" in cmd:
                continue
            cfg = {**base, **sets, **BUDGET}
            if cfg.get("engine", "ray") == "ray":
                cfg["engine"] = "inprocess"
            for k in ("checkpoint-every",):
                if k in cfg:
                    cfg[k] = 2
            if int(cfg.get("num-chains", 1)) > 4:
                cfg["num-chains"] = 4
            cfg.setdefault("run-name", f"doc{len(runs)}")
            assert cli.main(["run", *(["--config", conf] if conf else []), *_sets(cfg)]) == 0, (where, cmd)
            runs.append(tmp_path / "outputs" / str(cfg["run-name"]))
        else:  # config and the like
            assert cli.main(argv) == 0, (where, cmd)
    assert len(runs) >= 7, runs  # the README's, the user guide's, the experiments', reliability's
    for where, cmd in plots:  # `plot <run>`: on a run made above
        assert cli.main(["plot", str(runs[0])]) == 0, (where, cmd)
    assert (runs[0] / "overview.png").exists() and plots
    capsys.readouterr()


def _sets(cfg: dict) -> list[str]:
    out = []
    for k, v in cfg.items():
        out += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def test_every_documented_deploy_command_runs(tmp_path):
    from qlsd_flwr.deploy.cli import main as deploy

    seen = set()
    for where, cmd in commands():
        env, words = _argv(cmd)
        if words[:3] != ["python", "-m", "qlsd_flwr.deploy"] or "<" in cmd or "..." in cmd:
            continue
        sub, rest = words[3], words[4:]
        seen.add(sub)
        scratch = tmp_path / f"{sub}{len(seen)}"
        # absolute and /tmp paths of the docs are redirected into the scratch folder
        rest = [str(scratch / a.lstrip("/")) if a.startswith("/") or a.endswith("/") else a for a in rest]
        rest = [str(REPO / a) if a.startswith("conf/") else a for a in rest]
        if sub == "ray-state":  # needs a running cluster (tests/test_deployment.py runs it against one)
            continue
        if sub in ("certs", "node-key"):
            rest = [str(scratch / a) if i == 0 else a for i, a in enumerate(rest)]
        assert deploy([sub, *rest]) == 0, (where, cmd)
    assert {"certs", "partition", "stage-app"} <= seen, seen


@pytest.mark.docs_smoke  # with the commands it checks, after the suite: 30-odd processes importing numpy and torch
def test_every_documented_script_exists_and_takes_the_options_given():
    given: dict[str, set[str]] = {}
    for where, cmd in commands():
        _, words = _argv(cmd)
        script = next((w for w in words if w.endswith(".py") and ("benchmarks/" in w or "simulations/" in w)), None)
        if script is not None:
            assert (REPO / script).is_file(), (where, cmd)
            opts = {w.split("=", 1)[0] for w in words[words.index(script) + 1:] if w.startswith("--")}
            given.setdefault(script, set()).update(opts)
    assert len(given) > 10, given
    # each script's --help, side by side (each imports numpy, some torch: seconds apiece)
    procs = {sc: subprocess.Popen([sys.executable, str(REPO / sc), "--help"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=REPO) for sc in given}
    for sc, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (sc, err[-2000:])
        missing = sorted(o for o in given[sc] if o not in out)
        assert not missing, (sc, missing)


def _script_commands() -> list[str]:
    """Each documented benchmark or simulation command once (an elided ``…`` form is listed whole
    elsewhere)."""
    out = []
    for _, cmd in commands():
        words = _argv(cmd)[1]
        if any(w.endswith(".py") and ("benchmarks/" in w or "simulations/" in w) for w in words):
            if "..." not in cmd and "…" not in cmd and "<" not in cmd:
                out.append(" ".join(words).replace(".venv/bin/python ", "python "))
    return sorted(set(out))


def _recorded() -> dict[str, float]:
    """The recorded results' modification times (a smoke run must leave them alone)."""
    files = [*(REPO / "benchmarks").glob("*.json"), *(REPO / "benchmarks").glob("*.png"),
             *(REPO / "simulations" / "results").rglob("*")]
    return {str(f): f.stat().st_mtime for f in files if f.is_file()}


@pytest.mark.docs_smoke  # CI runs these after the suite (.ci/run): about 5 CPU-minutes in all
@pytest.mark.parametrize("cmd", _script_commands())
def test_every_documented_script_command_runs_at_a_smoke_size(cmd, tmp_path):
    words = shlex.split(cmd)
    assert words[0] == "python", cmd
    before = _recorded()
    env = {**__import__("os").environ, "QLSD_SMOKE": str(tmp_path / "smoke"), "OMP_NUM_THREADS": "1",
           "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, *words[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (cmd, proc.stdout[-1500:], proc.stderr[-3000:])
    assert proc.stdout.strip() or any((tmp_path / "smoke").rglob("*")), cmd  # it reported or wrote something
    assert _recorded() == before, cmd  # no recorded result was overwritten
