"""``qlsd-flwr check [APP_DIR] [--run-config STRING]``: a Flower app's run-config keys, checked before
``flwr run``.

``flwr run APP_DIR --run-config 'k=v'`` refuses a key that ``APP_DIR/pyproject.toml`` does not declare
in ``[tool.flwr.app.config]`` with only ``[code: 15] Invalid run configuration.``: the key is named in
the SuperLink's log alone, and the package never sees it. This check names it, one line a problem
(``where: key: what``), before anything runs:

* the declared keys, against the key table (:data:`qlsd_flwr.keys.DEFAULTS`, ``_`` read as ``-`` as
  :func:`qlsd_flwr.config.resolve` reads it). An app whose ServerApp or ClientApp is the package's
  (a ``qlsd_flwr.…`` module in ``[tool.flwr.app.components]``, as in this repository's
  ``pyproject.toml``) hands every key to :func:`~qlsd_flwr.config.resolve`, so a key outside the table
  is a problem (the run would stop at its start). A user's own apps (``examples/quickstart-torch``)
  read the keys they choose, so such a key is the app's own: a warning when it is close to a table
  key (a did-you-mean), nothing otherwise;
* the ``--run-config`` strings, read by Flower's own parser (:func:`flwr.common.config.parse_config_args`;
  also a ``.toml`` file, as ``flwr run`` takes it): a key the app does not declare is a problem
  (Flower refuses it), with a did-you-mean when it is no table key either; text Flower's parser
  would drop silently (``num-rounds 300``) and values that are no TOML (``variant=qlsd``) too;
* the values, as far as they can be checked without running: the package's apps, the declared
  values and then those with the run config laid over them through :func:`~qlsd_flwr.config.resolve`
  (the checks involving several keys too); a user's apps, each table key's value by its own rule
  (:func:`qlsd_flwr.keys.parse`), since such an app may pass them on under other names or not at all.

A missing or unreadable ``pyproject.toml``, or one without the table, is one line naming the file.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from qlsd_flwr.config import resolve
from qlsd_flwr.keys import DEFAULTS, ConfigError, close_keys, parse

# the key=value pairs of flwr.common.config.parse_config_args (its own pattern, a local variable there):
# used only to name the pair Flower's parser refuses, and what it would drop without a word
_FLWR_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")
REFUSED = "flwr run refuses it ([code: 15] Invalid run configuration.)"


@dataclass
class Report:
    """What :func:`check_app` found: ``problems`` (exit code 2), ``warnings``, and the ``ok`` line."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ok: str = ""

    @property
    def code(self) -> int:
        return 2 if self.problems else 0

    def emit(self) -> int:
        """Print the problems and warnings (standard error) or the ``ok`` line (standard output)."""
        for line in self.warnings + self.problems:
            print(line, file=sys.stderr)
        if not self.problems:
            print(self.ok)
        return self.code


def in_table(key: str) -> bool:
    return key.replace("_", "-") in DEFAULTS


def did_you_mean(key: str, keys=None) -> str:
    close = close_keys(key.replace("_", "-"), keys)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def read_toml(file: Path, name: str, error: type[Exception] = ConfigError) -> dict:
    """The TOML file ``file``; ``error`` with one line (beginning with ``name``) when it cannot be read."""
    if not file.exists():
        raise error(f"{name}: not found")
    if file.is_dir():
        raise error(f"{name}: is a folder, not a TOML file")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{name}: TOML syntax error: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{name}: cannot be read ({exc})") from None


def read_app(app_dir: str | Path) -> tuple[Path, dict, dict]:
    """``(pyproject, declared keys, components)`` of the app in ``app_dir`` (or the ``pyproject.toml``
    given); ``ConfigError`` naming the file when it cannot be read or declares no run config."""
    from flwr.common.config import flatten_dict

    where = Path(app_dir)
    file = where if where.suffix == ".toml" and not where.is_dir() else where / "pyproject.toml"
    app = read_toml(file, str(file)).get("tool", {}).get("flwr", {}).get("app", {})
    if not isinstance(app, dict) or not isinstance(app.get("config"), dict):
        raise ConfigError(f"{file}: no [tool.flwr.app.config] table, so {REFUSED} every --run-config key "
                          "(`qlsd-flwr config --toml` prints the table with every key)")
    components = app.get("components", {}) if isinstance(app.get("components"), dict) else {}
    return file, flatten_dict(app["config"]), components


def parse_run_config(strings: list[str], report: Report) -> dict:
    """The ``--run-config`` strings as Flower reads them (problems into ``report``)."""
    from click import ClickException
    from flwr.common.config import parse_config_args

    for s in strings:
        if s.strip().endswith(".toml"):
            continue
        if dropped := _FLWR_PAIR.sub(" ", s).split():
            report.problems.append(f"--run-config: {' '.join(dropped)!r}: not key=value, so Flower's parser "
                                   "drops it without a word (write 'key=value key2=\"text\"')")
    try:
        return parse_config_args(strings)
    except ClickException as exc:  # name the pairs that are no TOML (a text value without quotes, most often)
        before = len(report.problems)
        for s in strings:
            for k, v in _FLWR_PAIR.findall(s):
                try:
                    tomllib.loads(f"{k} = {v}")
                except tomllib.TOMLDecodeError:
                    report.problems.append(f"--run-config: {k}: {v} is no TOML value, so flwr run refuses the "
                                           f"whole string (text needs quotes: {k}=\"{v}\")")
        if len(report.problems) == before:  # each pair alone is TOML (a key given twice, ...): Flower's words
            report.problems.append(f"--run-config: {exc.message}")
    except (ValueError, OSError) as exc:  # a .toml file that is missing, unreadable or mixed with pairs
        report.problems.append(f"--run-config: {exc}")
    return {}


def check_app(app_dir: str | Path = ".", run_config: list[str] | None = None) -> Report:
    """Check the app in ``app_dir`` and the ``flwr run --run-config`` strings (see the module)."""
    report = Report()
    try:
        file, declared, components = read_app(app_dir)
    except ConfigError as exc:
        report.problems.append(str(exc))
        return report
    ours = [f"{role} = {components[role]}" for role in ("serverapp", "clientapp")
            if str(components.get(role, "")).startswith("qlsd_flwr.")]
    own = _check_declared(file, declared, ours, report)
    given = parse_run_config(list(run_config or []), report)
    for k in (k for k in given if k not in declared):
        if k.replace("_", "-") in declared:
            report.problems.append(f"--run-config: {k}: Flower matches keys as written and {file} declares "
                                   f"{k.replace('_', '-')}: write that")
        elif in_table(k):
            report.problems.append(f"--run-config: {k}: not declared in {file} [tool.flwr.app.config], so "
                                   f"{REFUSED}; declare it there")
        else:
            hint = did_you_mean(k, dict.fromkeys([*declared, *DEFAULTS]))
            report.problems.append(f"--run-config: {k}: unknown key{hint}: neither a qlsd-flwr key nor declared in "
                                   f"{file} [tool.flwr.app.config], so {REFUSED}")
    _check_values(file, declared, given, bool(ours), report)
    keys = (f"{len(declared)} keys declared, all qlsd-flwr keys" if not own else f"{len(declared)} keys declared "
            f"({len(declared) - len(own)} qlsd-flwr keys, {len(own)} the app's own: {', '.join(own)})")
    named = ", ".join(given) if len(given) <= 6 else f"{len(given)} keys"
    rc = f"; --run-config: {named} declared and valid" if given else ""
    roles = [r.split(" = ")[0] for r in ours]
    rule = f" (qlsd_flwr's {' and '.join(roles)} read{'s' if len(roles) == 1 else ''} every key)" if ours else ""
    report.ok = f"ok: {file}: {keys}, values valid{rc}{rule}"
    return report


def _check_declared(file: Path, declared: dict, ours: list[str], report: Report) -> list[str]:
    """The declared keys outside the table (problems where the package's apps read them all)."""
    own = []
    for k in declared:
        if in_table(k):
            continue
        own.append(k)
        hint = did_you_mean(k)
        if ours:
            report.problems.append(f"{file}: {k}: not a qlsd-flwr key{hint}; the package's apps ({', '.join(ours)}) "
                                   "read every declared key, so the run would stop at its start")
        elif hint:
            report.warnings.append(f"warning: {file}: {k}: not a qlsd-flwr key{hint}; fine if your own app reads it")
    return own


def _check_values(file: Path, declared: dict, given: dict, ours: bool, report: Report) -> None:
    """The table keys' values: through ``resolve`` for the package's apps, each by its rule otherwise."""
    base = {k: v for k, v in declared.items() if in_table(k)}
    over = {k: v for k, v in given.items() if in_table(k)}
    folder = str(file.parent.resolve())
    sys.path.insert(0, folder)  # the app's folder, as under flwr run: a task or model plug-in of the app
    try:
        if ours:
            for source, keys in ((str(file), base), ("--run-config", {**base, **over})):
                try:
                    resolve(keys)
                except ConfigError as exc:
                    report.problems.append(f"{source}: {exc}")
                    return
        else:
            for source, keys in ((str(file), base), ("--run-config", over)):
                for k, v in keys.items():
                    try:
                        parse(k.replace("_", "-"), v)
                    except ConfigError as exc:
                        report.problems.append(f"{source}: {exc}")
    finally:
        sys.path.remove(folder)
