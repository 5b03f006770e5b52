"""The chains of a grid of (sampler × engine × metric kind × chains), recorded once from main before
the sampler refactor (issue 36) and compared by ``tests/test_equivalence.py``: a refactor changes no
chain.

``python tests/golden.py record [CELL ...]`` rewrites ``tests/data/golden_chains.npz``, or only the cells named
(only when a change of the chain is intended, and said so in the commit); ``python tests/golden.py compare`` prints, cell by cell,
whether today's code gives the recorded draws bit for bit (the test allows a last-bit tolerance, so it
does not depend on the machine's libm).

Each cell is small (4 clients, d ≤ 8, 20 to 25 rounds) so the whole grid costs seconds; together the
cells touch every sampler on the local engine, every sampler on the vectorised engine (numpy backend,
two chains), the QLSD family on the numba backend, the in-process Flower path with two chains for one
sampler of each family, every metric kind (identity, diagonal, dense, Kronecker, a low-rank
correction), ``gamma = auto``, θ* by descent, QSGD-coded rivals, VR-FALD*'s refresh and the logistic task.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

PATH = Path(__file__).parent / "data" / "golden_chains.npz"

P4 = "0.9,0.6,0.8,0.5"
BASE = {"task": "gaussian", "num-clients": 4, "dim": 6, "prior-var": 5.0, "num-rounds": 25, "burn-in": 0,
        "progress": False, "gamma": 4.9e-4, "loo": "off", "plot": False, "seed": 7}
SAMPLERS = {
    "qlsd": {"variant": "qlsd", "s": "8", "p": P4},
    "qlsd-sharp": {"variant": "qlsd-sharp", "s": "8", "p": P4, "batch-fraction": 0.3},
    "qlsd-star": {"variant": "qlsd-star", "s": "8", "p": P4, "theta-star": "optimise"},
    "qlsd-pp": {"variant": "qlsd-pp", "s": "4", "p": P4, "l": 7},
    "lsd-star": {"variant": "lsd-star", "p": P4},
    "lsd-pp": {"variant": "lsd-pp", "p": P4, "l": 5, "aggregation": "active-fraction"},
    "sgld": {"variant": "sgld", "batch-fraction": 0.3},
    "fald": {"variant": "fald", "p": P4, "local-steps": 2, "tau": 0.3},
    "vr-fald-star": {"variant": "vr-fald-star", "p": P4, "local-steps": 2, "q": 0.3, "compressor": "qsgd", "s": "8"},
    "dg-lmc": {"variant": "dg-lmc", "p": P4, "local-steps": 2},
    "fsgld": {"variant": "fsgld", "local-steps": 2, "compressor": "qsgd", "s": "8"},
}
METRICS = {  # (sampler, extra keys)
    # recorded before compression-basis existed: the paper's basis, as then (issue 37 made metric the default)
    "qlsd-pp-diagonal-auto": ("qlsd-pp", {"metric": "diagonal", "gamma": "auto", "compression-basis": "theta"}),
    "lsd-pp-dense": ("lsd-pp", {"metric": "dense", "dim": 8}),
    "lsd-star-diagonal-rank": ("lsd-star", {"metric": "diagonal", "metric-rank": 2, "dim": 8}),
    "fald-dense": ("fald", {"metric": "dense", "dim": 8}),
    "dg-lmc-dense": ("dg-lmc", {"metric": "dense"}),
    "fsgld-diagonal-rank": ("fsgld", {"metric": "diagonal", "metric-rank": 2, "dim": 8}),
    "qlsd-pp-logistic-kron": ("qlsd-pp", {"task": "logistic", "metric": "kronecker", "gamma": "auto", "num-rounds": 15,
                                          "compression-basis": "theta"}),
    "vr-fald-star-logistic-kron": ("vr-fald-star", {"task": "logistic", "metric": "kronecker", "gamma": "auto",
                                                    "num-rounds": 15}),
}
INPROCESS = ("qlsd-pp", "lsd-star", "fald", "vr-fald-star", "dg-lmc", "fsgld")
NUMBA = ("qlsd", "qlsd-sharp", "qlsd-star", "qlsd-pp", "lsd-pp")


def cells() -> list[tuple[str, str, dict]]:
    """``(name, engine, overrides)`` for every cell of the grid."""
    out = []
    for name, over in SAMPLERS.items():
        out.append((f"local/{name}", "local", {**BASE, **over}))
        out.append((f"vectorised-numpy/{name}", "vectorised-numpy", {**BASE, **over, "num-chains": 2}))
    for name in NUMBA:
        out.append((f"vectorised-numba/{name}", "vectorised-numba", {**BASE, **SAMPLERS[name], "num-chains": 2}))
    for name, (sampler, extra) in METRICS.items():
        out.append((f"local/{name}", "local", {**BASE, **SAMPLERS[sampler], **extra}))
    for name in INPROCESS:
        out.append((f"inprocess/{name}", "inprocess", {**BASE, **SAMPLERS[name], "num-chains": 2}))
    return out


def run_cell(engine: str, over: dict, tmp: Path) -> np.ndarray:
    """The cell's draws: ``(rounds, d)`` for one chain, ``(chains, rounds, d)`` for several."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.engines.local import run_local
    from qlsd_flwr.engines.vectorised import run_vectorised
    from qlsd_flwr.run.simulate import run_inprocess

    o = {**over, "output-dir": str(tmp)}
    if engine == "local":
        return np.asarray(run_local(resolve({**o, "engine": "local"}), write=False, keep_trace=True,
                                    progress=False).trace)
    if engine.startswith("vectorised"):
        res = run_vectorised(resolve({**o, "engine": "vectorised"}), write=False, keep_trace=True, progress=False,
                             backend=engine.split("-")[1])
        return np.asarray(res.trace)
    o = {**o, "engine": "inprocess"}
    strat = run_inprocess(resolve(o), o, shuffle_seed=11, strategy_kwargs={"keep_trace": True})
    return np.moveaxis(np.asarray(strat.trace), 1, 0)  # (rounds, chains, d) -> (chains, rounds, d)


def record(names: list[str] | None = None) -> None:
    """Record every cell, or only ``names`` (the cells whose chain a change moved on purpose; the others keep the
    draws recorded before), printing how far each named cell moved."""
    import tempfile

    old = dict(np.load(PATH)) if names and PATH.exists() else {}
    unknown = sorted(set(names or []) - {c[0] for c in cells()})
    if unknown:
        sys.exit(f"golden.py record: no cell named {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        arrays = {name: run_cell(engine, over, Path(tmp)) for name, engine, over in cells()
                  if not names or name in names}
    for name in names or []:
        if name in old and old[name].shape == arrays[name].shape:
            move = float(np.max(np.abs(arrays[name] - old[name])) / np.max(np.abs(old[name])))
            print(f"{name}: moved by {move:.3g} of its largest draw")
    PATH.parent.mkdir(exist_ok=True)
    np.savez_compressed(PATH, **{**old, **arrays})
    print(f"recorded {len(arrays)} cells in {PATH}")


def compare() -> int:
    import tempfile

    want = np.load(PATH)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, engine, over in cells():
            got = run_cell(engine, over, Path(tmp))
            same = got.shape == want[name].shape and np.array_equal(got, want[name])
            bad += not same
            print(f"{'bitwise' if same else 'DIFFERS'}  {name}")
    print(f"{len(cells()) - bad} of {len(cells())} cells bit for bit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1:2] == ["record"]:
        record(sys.argv[2:])
    elif sys.argv[1:] == ["compare"]:
        sys.exit(compare())
    else:
        sys.exit("usage: python tests/golden.py record [CELL ...] | compare")
