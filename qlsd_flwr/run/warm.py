"""Compile the package's numba kernels into their on-disk cache before the first run needs them.

``python -m qlsd_flwr.run.warm`` runs a few runs of a handful of rounds, written to a temporary folder, whose paths
between them reach every kernel the package compiles: the vectorised engine's numba backend on the Gaussian and the
logistic task, its numpy backend with QSGD's uplink and the compressed broadcast in their codes (Elias, packed,
arithmetic, Rice), and the local engine's server decoding them. ``./dev`` runs it once, at its first-use setup
(about a minute on 2 cores), so the first run, and the test suite after a fresh clone, load the kernels instead of
compiling them, and the suite's workers do not compile the same kernel side by side. It changes nothing but numba's
cache (``qlsd_flwr/jit.py``): a kernel it did not reach compiles on first use, as before.
"""

from __future__ import annotations

import tempfile


def warm() -> int:
    """Run the warm-up runs; the number of runs."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.engines.local import run_local
    from qlsd_flwr.engines.vectorised import run_vectorised

    base = {"num-clients": 3, "num-rounds": 4, "burn-in": 1, "progress": False, "plot": False, "loo": "off",
            "seed": 0, "s": "4"}
    gauss = {**base, "task": "gaussian", "dim": 5, "gamma": 1e-3}
    digits = {**base, "task": "logistic", "dataset": "digits", "gamma": 1e-4, "prior-var": 0.05}
    runs = [
        (run_vectorised, {**gauss, "engine": "vectorised", "vectorised-backend": "numba", "num-chains": 2}),
        (run_vectorised, {**digits, "engine": "vectorised", "vectorised-backend": "numba", "num-chains": 2}),
        (run_vectorised, {**digits, "engine": "vectorised", "vectorised-backend": "numpy", "num-chains": 2,
                          "encoding": "arith", "downlink": "qsgd", "downlink-s": 8}),
        (run_vectorised, {**gauss, "engine": "vectorised", "vectorised-backend": "numpy", "num-chains": 2, "p": "0.7",
                          "downlink": "qsgd", "downlink-s": 512}),
        (run_local, {**gauss, "encoding": "elias"}),
        (run_local, {**gauss, "encoding": "packed", "s": "64"}),
        (run_local, {**digits, "encoding": "arith", "downlink": "qsgd", "downlink-s": 8}),
    ]
    with tempfile.TemporaryDirectory() as out:
        for run, over in runs:
            run(resolve({**over, "output-dir": out}))
    return len(runs)


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    n = warm()
    print(f"[dev] numba kernels compiled into their cache ({n} short runs, {time.perf_counter() - t0:.0f} s)")
