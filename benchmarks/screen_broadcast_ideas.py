"""Ways to a cheaper broadcast on the main job, screened against the HMC reference (issue 37). The first was screened
here and is in the package since (``downlink-support = data``, the default: with it this patch codes what the
package codes); the others are not. Each row is ``bench_mainjob_reference.py``'s ``--sweep`` row (the main job on the vectorised engine's numpy
backend, the Ray engine's chains) with the broadcast's rule patched here:

* ``--idea support``: the broadcast codes only the coordinates of θ that some client's data touch. For the main job's
  softmax regression a client's gradient depends on θ only through ``X_i W``, so the weights of an input pixel that is
  0 in every client's data (127 of 785 on the main job's 4,000 digits: 1,270 of 7,850 coordinates) change no client's
  gradient. Those coordinates are left out of the code, and the server's ``w`` there is θ itself (the lag's correction
  and the prior's gradient at ``w`` then see no lag there). They carry the prior's scale, the widest, so leaving them
  out also shrinks the norm QSGD's levels are cut from. Built since (``core/downlink.py``).
* ``--idea block-basis``: the broadcast coded in the clients' block basis ``B`` (``core/block_basis.py``, which the
  clients already hold for ``compression-basis = block``): ``C(B⁻¹ (θ_k − w))``, ``w`` moved by ``α B C(·)``.

    python benchmarks/screen_broadcast_ideas.py --idea support --sweep base downlink-s=24 downlink-s=16 \\
        --out broadcast_support_screen.json
    python benchmarks/screen_broadcast_ideas.py --idea block-basis --sweep base downlink-s=16 \\
        --out broadcast_block_basis_screen.json
    python benchmarks/screen_broadcast_ideas.py --idea client-support --sweep base --out broadcast_client_support_screen.json

* ``--idea client-support`` (since ``downlink-support = data`` is built): the chain unchanged, the bits it would
  take to send each client only the levels on its *own* support (of the union's code: the same norm, ``α`` and
  dither, so every client still builds the server's ``w`` where its gradient reads it). Printed at the end beside
  what the union's code sends. The package does it since 2026-12-07 (``Downlink.code_for``); every idea here sends
  each client the whole code, as when these screens ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from qlsd_flwr.core import downlink as D  # noqa: E402
from qlsd_flwr.engines.vectorised import numpy_backend as NB  # noqa: E402

IDEAS = ("support", "block-basis", "client-support")
#: ``--idea client-support``: [union's code bits to every client, each client's own code bits] over the run
TALLY = [0, 0]


def _scaled_code(rule: D.Downlink, x: np.ndarray, seed: int, k: int):
    """``(α C(x), levels)``: the package's own coding of ``x`` (:meth:`Downlink.step` from ``w = 0``), ``α`` for
    ``x``'s length."""
    return D.Downlink.step(rule, x, np.zeros_like(x), seed, k)


class SupportDownlink(D.Downlink):
    """Codes θ_k − w on ``live`` only; ``w = θ`` elsewhere (on the server; no client's gradient reads it)."""

    live: np.ndarray

    def step(self, theta, w, seed, k):
        if w is None:
            return theta.copy(), None
        L = self.live
        step, q = _scaled_code(self, (theta - w)[L], seed, k)
        out = theta.copy()
        out[L] = w[L] + step
        return out, q


class BasisDownlink(D.Downlink):
    """Codes ``B⁻¹ (θ_k − w)`` and moves ``w`` by ``B (α C(·))``."""

    basis: object

    def step(self, theta, w, seed, k):
        if w is None:
            return theta.copy(), None
        step, q = _scaled_code(self, self.basis.apply_inv(theta - w), seed, k)
        return w + self.basis.apply_root(step), q


def _recording(compressor, positions):
    """``compressor`` (the broadcast's QSGD), whose every code also tallies the codes of each client's subset of the
    levels (``positions``: each client's support as positions in the union) into :data:`TALLY`."""
    from dataclasses import fields

    from qlsd_flwr.compression.qsgd import Quantised

    class Recording(type(compressor)):
        def encode(self, q):
            code = super().encode(q)
            TALLY[0] += 8 * len(code) * len(positions)
            for pos in positions:
                TALLY[1] += 8 * len(super().encode(Quantised(q.norms, q.levels[pos], q.s, (pos.size,))))
            return code

    return Recording(**{f.name: getattr(compressor, f.name) for f in fields(compressor)})


def patch(idea: str) -> None:
    """The vectorised engine's broadcast rule swapped for ``idea``'s (the chains' own rule otherwise unchanged)."""
    orig = NB.NumpyGeneric.__init__

    def init(self, cfg, task, specs, spec, *a, **kw):
        orig(self, cfg, task, specs, spec, *a, **kw)
        if not self.down.on:
            return
        r = self.down.rule
        self.down.own = [None] * cfg.b  # every client sent the whole code, as when these screens ran (2026-12-06)
        if idea == "client-support":
            from qlsd_flwr.core.potential import declared_support

            union = r.support if r.support is not None else np.arange(task.dim)
            own = [np.flatnonzero(declared_support(c, task.dim)) for c in task.clients]
            positions = [np.searchsorted(union, o) for o in own]
            print(f"clients' own supports: {min(o.size for o in own)}–{max(o.size for o in own)} of the union's "
                  f"{union.size} coordinates", file=sys.stderr)
            self.down.rule = dataclasses.replace(r, compressor=_recording(r.compressor, positions))
            return
        if idea == "support":
            X = np.vstack([c.Xa for c in task.clients])
            live = np.repeat((X != 0).any(axis=0), task.clients[0].n_classes)  # θ is the (F̃, K) matrix, row-major
            new = SupportDownlink(r.compressor, r.feedback, r.dither)
            object.__setattr__(new, "live", live)
            print(f"broadcast on the data's support: {int(live.sum())} of {live.size} coordinates", file=sys.stderr)
        else:
            if getattr(spec, "whitening", None) is None:
                raise SystemExit("--idea block-basis needs compression-basis = block (the main job's)")
            new = BasisDownlink(r.compressor, r.feedback, r.dither)
            object.__setattr__(new, "basis", spec.whitening)
        self.down.rule = new

    NB.NumpyGeneric.__init__ = init


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--idea", choices=IDEAS)
    ap.add_argument("-h", "--help", action="store_true")
    a, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    from benchmarks import bench_mainjob_reference

    if a.help:  # this script's option, then the sweep's own (it exits after printing them)
        print(f"--idea {{{','.join(IDEAS)}}}: the patched broadcast (the module docstring); the other options are "
              "bench_mainjob_reference.py's:")
        bench_mainjob_reference.main(["--help"])
    if a.idea is None:
        raise SystemExit(f"--idea: missing; allowed: {', '.join(IDEAS)}")
    patch(a.idea)
    bench_mainjob_reference.main(rest)
    if a.idea == "client-support":
        print(f"the broadcast's codes after round 0: the union's to every client {TALLY[0]:.4g} bits, each client's "
              f"own support {TALLY[1]:.4g} bits ({TALLY[1] / max(TALLY[0], 1):.3f}×)")


if __name__ == "__main__":
    main()
