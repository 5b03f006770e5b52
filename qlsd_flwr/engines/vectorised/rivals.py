"""The rivals (FALD, VR-FALD*, DG-LMC, FSGLD) on the vectorised engine.

Their clients run local chains (several Langevin or ULA steps a round, on each client's own
state), so there is no single oracle to batch over chains and clients as
:class:`~qlsd_flwr.engines.vectorised.numpy_backend.NumpyGeneric` batches the QLSD family's. This
runner serves the chains with the protocol's own pieces, called directly as the ``local`` engine
calls them: a :class:`~qlsd_flwr.protocol.chains.ChainSet` (one
:class:`~qlsd_flwr.protocol.server.QLSDServer` a chain, seed ``seed + c``) on the server side and
:func:`qlsd_flwr.protocol.client.handle` on each client's side, with the messages as bytes. Chain
``c`` is then the ``local`` engine's run with seed ``seed + c`` bit for bit, and every check the
protocol makes (validation, the bounded-influence rule, run-away detection) runs as it does there.
What the engine adds is its own: several chains and configurations side by side in one pass
(:func:`~qlsd_flwr.engines.vectorised.driver.run_side_by_side`: a rival next to the QLSD family on
the same seeds), its statistics, outputs and checkpoints. It is not faster than the ``local``
engine per chain: the cost is the clients' local steps.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from qlsd_flwr.core.oracles import ClientState, full_local_grad
from qlsd_flwr.engines.local import direct_round
from qlsd_flwr.engines.vectorised.results import keeps
from qlsd_flwr.outputs.jsonio import dumps
from qlsd_flwr.protocol.chains import ChainSet
from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.protocol.traffic import count_claims


class RivalChains:
    """``C`` chains of a rival variant (see the module docstring); the runner interface of
    :class:`~qlsd_flwr.engines.vectorised.numpy_backend.NumpyGeneric`."""

    def __init__(self, cfg, task, specs, prep, stats):
        self.cfg, self.task, self.specs, self.stats = cfg, task, specs, stats
        self.d, self.b = task.dim, cfg.b
        # the driver has warned, and restores a resumed run's servers itself (restore): they start afresh here
        fresh = dataclasses.replace(cfg, raw={**cfg.raw, "resume": ""})
        self.set = ChainSet(fresh, task, engine_label="vectorised", warn=False)
        self.set.begin(prep.theta_star, prep.info, None, prep)
        if self.set.wants_claims():  # VR-FALD*, FSGLD: the clients' ∇U_i(θ*), as the engines ask them
            self.set.set_claims([full_local_grad(s, task.clients[s.index], prep.theta_star) for s in specs])
            count_claims(prep.info, cfg.b, task.dim)
        self.clients = [[ClientState() for _ in range(cfg.b)] for _ in range(self.set.C)]

    @property
    def spec(self):
        """Chain 0's server spec (its ``γ`` and metric go into the checkpoint's checks)."""
        return self.set.chains[0].spec

    @property
    def theta(self) -> np.ndarray:
        return self.set.state.theta

    def initial_block(self) -> int:
        return 16

    def next_block(self, R, dt) -> int:
        return int(min(4096, max(1, R * 0.5 / max(dt, 1e-6))))

    def info(self) -> dict:
        """The chains' servers' counts (rejections, missed rounds, exclusions), as a Flower run's summary has."""
        return self.set.facts()

    def close(self) -> None:
        pass

    def theta_of(self, v: int) -> np.ndarray:
        return self.theta

    def run_block(self, k0: int, R: int, need_states: bool) -> dict:
        C = self.set.C
        out = {"n_active": np.zeros((C, R), np.int64), "skipped": np.zeros((C, R), np.int64),
               "bits_exact": np.zeros((C, R), np.int64), "bits_bound": np.zeros((C, R)),
               "bytes": np.zeros((C, R), np.int64), "bits_down": np.zeros((C, R), np.int64), "error": None}
        states = np.full((C, R, self.d), np.nan) if need_states else None
        for r in range(R):
            try:
                rows = [self._round(c) for c in range(C)]
            except (ValueError, DivergenceError) as exc:  # a message that cannot be formed; a run-away chain
                out["error"] = str(exc)
                break
            for c, row in enumerate(rows):
                out["n_active"][c, r], out["skipped"][c, r] = row["n_active"], row["skipped"]
                out["bits_exact"][c, r], out["bits_bound"][c, r] = row["bits_exact"], row["bits_bound"]
                out["bytes"][c, r], out["bits_down"][c, r] = row["bytes_payload"], row["bits_down"]
            theta = self.theta
            if need_states:
                states[:, r] = theta
            self.stats.add_round(theta, bool(keeps(np.asarray(k0 + r + 1), self.cfg.burn_in, self.cfg.thin)), out, r)
        out["states"] = states
        return out

    def _round(self, c: int) -> dict:
        """One round of chain ``c``: its server, its clients called directly (``engines.local``)."""
        return direct_round(self.set.chains[c], self.specs, self.clients[c], self.task, self.cfg.seed + c, self.d)

    # ---- checkpoints: the chains' servers' own snapshots ---------------------------------------
    def checkpoint_arrays(self) -> dict:
        arrays, _ = self.set.snapshot()
        return {**{k: v for k, v in arrays.items() if v is not None}, "n_kept": np.asarray(self.stats.n_kept)}

    def checkpoint_meta(self) -> dict:
        """The chains' servers' JSON state (their guards, counters, the θ* facts)."""
        return json.loads(dumps(self.set.snapshot()[1], strict=False))

    def restore(self, a: dict, meta: dict | None = None) -> None:
        """The state of :meth:`checkpoint_arrays` and :meth:`checkpoint_meta`; every client starts
        afresh, and the first message to each carries what it needs (the servers' resync)."""
        if meta is None:
            from qlsd_flwr.outputs.checkpoint import CheckpointError

            raise CheckpointError("checkpoint: the rivals' vectorised checkpoint lacks its 'runner' state")
        self.set.restore(meta, {k: v for k, v in a.items() if k != "n_kept"})
        self.clients = [[ClientState() for _ in range(self.b)] for _ in range(self.set.C)]
