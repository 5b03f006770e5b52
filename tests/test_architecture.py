"""The package's layering, checked on its source (README, "Architecture").

* arrows point down: a package imports only packages below it in :data:`LAYERS`;
* the mathematics (``core``, ``compression``) and the round protocol (``protocol``) import no
  Flower, no torch and no file I/O;
* a user who imports the strategy and the apps pulls in no experiment driver, no deployment
  tooling and no torch;
* no module is over 400 lines;
* no import cycle, and the mathematics reaches no configuration or I/O through any chain of imports.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qlsd_flwr"

# bottom to top; a package may import its own layer's modules and those of lower layers
LAYERS = [
    {"plugins", "data", "errors", "jit"},  # jit: numba's njit and where its kernels are cached
    {"core", "compression", "robust"},  # the mathematics, and the rules that judge what clients send
    {"samplers"},  # each sampler's declaration and its updates, built from the mathematics
    {"config", "keys", "keys_text", "bases"},  # the run's keys; the variant's choices come from the samplers
    {"outputs"},
    {"protocol"},
    {"tasks", "potentials"},
    {"engines", "flower", "evaluation"},
    {"run"},
    {"experiments", "deploy"},
    {"cli", "__main__", "__init__"},
]
RANK = {name: r for r, layer in enumerate(LAYERS) for name in layer}
PURE = ("core", "compression", "protocol", "robust", "samplers")
NO_IO = {"flwr", "torch", "os", "io", "pathlib", "json", "csv", "pickle", "tempfile", "shutil", "h5netcdf",
         "h5py", "subprocess", "socket"}


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        top = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        yield f, top, ast.parse(f.read_text())


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_every_package_has_a_layer():
    tops = {top for _, top, _ in _modules()}
    assert tops <= set(RANK), tops - set(RANK)


def test_imports_point_down():
    bad = []
    for f, top, tree in _modules():
        for m in _imports(tree):
            parts = m.split(".")
            if parts[0] == "qlsd_flwr" and len(parts) > 1 and parts[1] != top and RANK[parts[1]] > RANK[top]:
                bad.append(f"{f.relative_to(ROOT)} imports {m}")
    assert not bad, "\n".join(bad)


def test_the_mathematics_and_the_protocol_import_no_flower_torch_or_io():
    bad = []
    for f, top, tree in _modules():
        if top not in PURE:
            continue
        for m in _imports(tree):
            if m.split(".")[0] in NO_IO:
                bad.append(f"{f.relative_to(ROOT)} imports {m}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno} calls open()")
    assert not bad, "\n".join(bad)


def test_importing_the_strategy_pulls_in_no_experiment_deployment_or_torch():
    code = ("import sys\n"
            "import qlsd_flwr.flower.strategy, qlsd_flwr.flower.server_app, qlsd_flwr.flower.client_app\n"
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('qlsd_flwr.')}))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    pkgs, torch = out.stdout.strip().splitlines()
    for name in ("experiments", "deploy", "run", "engines", "evaluation"):
        assert f"'{name}'" not in pkgs, pkgs
    assert torch == "False"


def test_no_module_is_over_400_lines():
    sizes = {f.relative_to(PKG).as_posix(): len(f.read_text().splitlines()) for f in PKG.rglob("*.py")}
    long = {m: n for m, n in sizes.items() if n > 400}
    assert not long, f"split these modules below 400 lines (issue 36): {long}"


def _graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (at any depth of its code: a function's import too)."""
    names = {}
    for f in PKG.rglob("*.py"):
        parts = f.with_suffix("").relative_to(ROOT).parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                        for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        graph[name] = {m for m in out if m in names and m != name}
    return graph


def test_no_import_cycle():
    """No module reaches itself through the package's imports (Tarjan's strongly connected components)."""
    graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles
    # the test can fail: a cycle made by hand is found
    graph["qlsd_flwr.core.rng"] = graph["qlsd_flwr.core.rng"] | {"qlsd_flwr.core.oracles"}
    index.clear()
    low.clear()
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert any("qlsd_flwr.core.rng" in c for c in cycles)


def test_no_sampler_is_named_outside_its_declaration():
    """The package asks a sampler (``cfg.sampler``, ``spec.kind``), never compares ``variant`` or ``oracle``
    with a string outside ``qlsd_flwr/samplers/`` (issue 36: at most 3; 83 before)."""
    import re

    pattern = re.compile(r"(oracle|variant)\s*(==|!=|in\s*\(|not in)")
    hits = [f"{f.relative_to(ROOT)}:{n}" for f in PKG.rglob("*.py") if "samplers" not in f.parts
            for n, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert len(hits) <= 3, hits


def test_the_mathematics_reaches_no_configuration_files_or_flower_through_any_import():
    """Following every import through (not only the direct ones), ``core/`` and ``compression/`` reach only
    the mathematics' own layers: no sampler declaration, configuration, key table, outputs, protocol,
    Flower or engines."""
    graph = _graph()
    # qlsd_flwr.jit: how numba compiles and caches the kernels (paths of the package's own sources, no data)
    allowed = ("qlsd_flwr.core", "qlsd_flwr.compression", "qlsd_flwr.errors", "qlsd_flwr.robust", "qlsd_flwr.jit")
    bad = [f"{start} reaches {m}" for start in sorted(graph) if start.startswith(("qlsd_flwr.core", "qlsd_flwr.compression"))
           for m in sorted(_reach(graph, start)) if not m.startswith(allowed)]
    assert not bad, "\n".join(bad)
    assert "qlsd_flwr.config" in _reach(graph, "qlsd_flwr.protocol.precondition")  # the walk sees a real path


def _reach(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen
