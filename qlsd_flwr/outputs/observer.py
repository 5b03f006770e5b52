"""The run folder and the checkpoints of a Flower-path run (one chain, or the ``num-chains`` chains of a
:class:`~qlsd_flwr.protocol.chains.ChainSet`), written by observing its protocol server.

:class:`RunOutputs` is handed to :class:`~qlsd_flwr.protocol.server.QLSDServer` as its
``observer``: the server computes and keeps the chain's state; this object makes the run folder
(:func:`~qlsd_flwr.outputs.run_dir.make_run_dir`), records every round and kept draw
(:class:`~qlsd_flwr.outputs.recorder.Recorder`; ``server.state.theta`` is ``(d,)`` or ``(C, d)``), writes ``checkpoint.npz`` every
``checkpoint-every`` rounds from the server's :meth:`~QLSDServer.snapshot`, and with ``resume``
set reads the checkpoint back for the server to restore. Every engine with one chain per run
(local, in-process, Ray, deployment, legacy) uses it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from qlsd_flwr.config import RunConfig
from qlsd_flwr.outputs import checkpoint as ckpt
from qlsd_flwr.outputs.recorder import Recorder
from qlsd_flwr.outputs.stopsignal import deferred_signals
from qlsd_flwr.outputs.run_dir import make_run_dir

log = logging.getLogger("qlsd_flwr")


class RunOutputs:
    """Writes one chain's run folder and checkpoints (see the module docstring)."""

    def __init__(self, cfg: RunConfig, dim: int, run_dir=None):
        self.cfg, self.dim = cfg, dim
        self.run_dir: Path | None = None if run_dir is None else Path(run_dir)
        self.recorder: Recorder | None = None
        self.last_checkpoint: int | None = None  # round of the last checkpoint written or resumed
        self._resume: tuple[Path, dict, dict] | None = None

    def resume_snapshot(self) -> tuple[dict, dict] | None:
        """With ``resume`` set: the checkpoint's ``(meta, arrays)`` for the server to restore."""
        if ckpt.resume_dir(self.cfg) is None:
            return None
        self._resume = ckpt.load_for_resume(self.cfg, "server")
        run_dir, meta, arrays = self._resume
        log.info("resuming %s from its checkpoint at round %d", run_dir, int(meta["k"]))
        return meta, arrays

    def on_begin(self, server) -> None:
        self.cfg = cfg = server.cfg  # with the step chosen before sampling (gamma = auto) or the checkpoint's
        if self._resume is not None:
            self.run_dir, meta, arrays = self._resume
            self.last_checkpoint = int(meta["k"])
            self.recorder = Recorder(self.run_dir, cfg.to_dict(), self.dim, cfg.num_chains, cfg.burn_in, cfg.thin,
                                     resume=ckpt.recorder_part(meta, arrays),
                                     labels=server.task.meta.get("param_labels"))
            return
        self.run_dir = self.run_dir or make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
        self.recorder = Recorder(self.run_dir, cfg.to_dict(), self.dim, cfg.num_chains, cfg.burn_in, cfg.thin,
                                 labels=server.task.meta.get("param_labels"))

    def on_round(self, server, row: dict) -> None:
        k = row["round"]
        with deferred_signals():  # the row and its draw together (a stop then finds them consistent)
            self.recorder.record_round(row)
            self.recorder.record_sample(k, server.state.theta)
        if ckpt.due(self.cfg, k):
            self.save_checkpoint(server)

    def save_checkpoint(self, server) -> None:
        """Write ``checkpoint.npz`` (atomically) with the server's state and the recorder's position."""
        arrays, meta = server.snapshot()
        rec_meta, rec_arrays = self.recorder.checkpoint_state()
        arrays = {**arrays, **{f"rec_{k}": v for k, v in rec_arrays.items()}}
        ckpt.save(ckpt.path_in(self.run_dir), arrays, {**meta, "recorder": rec_meta})
        self.last_checkpoint = int(meta["k"])

    def on_stop(self, server, extra: dict) -> dict:
        """Close the folder (``samples.nc``, ``summary.json``); returns the summary."""
        if self.recorder is None:
            return extra
        summary = self.recorder.close(extra)
        self.recorder = None
        return summary
