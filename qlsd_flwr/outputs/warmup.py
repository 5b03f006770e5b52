"""The warm-up's state while ``metric-from = adapt`` runs (:class:`WarmupStore`): a run stopped during the
warm-up continues it bit for bit; in its own file, since the run folder is written only once ``M`` is
frozen."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from qlsd_flwr.config import RunConfig
from qlsd_flwr.outputs.checkpoint import RESUME_FREE_KEYS, CheckpointError, load, save
from qlsd_flwr.outputs.checkpoint_checks import VALUE_MAX


class WarmupStore:
    """Where ``metric-from = adapt`` keeps its warm-up's state (:mod:`qlsd_flwr.core.adapt`) while
    it runs: ``<output-dir>/.warmup-<digest>/state.npz``, the digest of the keys that change the chain (the
    run folder is written only once ``M`` is frozen). A run stopped during the warm-up and started
    again with the same keys continues it from there, bit for bit; the file is removed when the
    warm-up ends (``M`` then lives in the run folder's checkpoint)."""

    def __init__(self, cfg: RunConfig):
        chain_keys = {k: str(v) for k, v in sorted(cfg.raw.items()) if k not in RESUME_FREE_KEYS}
        digest = hashlib.sha1(json.dumps(chain_keys, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(str(cfg.get("output-dir"))) / f".warmup-{digest}" / "state.npz"  # its own folder: a
        # concurrent run's temporary files are never touched (save removes stale ones in the file's folder)
        self.config = chain_keys

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from qlsd_flwr.core.metric_codec import to_array

        arrays = {"theta": state["theta"], "kept": state["kept"], "metric": to_array(state["metric"])}
        save(self.path, arrays, {"kind": "warmup", "config": self.config, "r": state["r"], "w_idx": state["w_idx"],
                                 "gamma": state["gamma"], "history": state["history"]})

    def load(self, chains: int, d: int, kind: str, rounds: int) -> dict | None:
        """The state kept, checked against this run (``chains`` chains, ``d`` coordinates, a ``kind``
        metric, a warm-up of ``rounds`` rounds), or ``None`` when there is none; :class:`CheckpointError`
        naming the file and field."""
        if not self.path.exists():
            return None
        from qlsd_flwr.core.metric import MetricError
        from qlsd_flwr.core.metric_codec import from_array

        meta, a = load(self.path)

        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"warm-up state {self.path}: {why} (remove the file to start the warm-up again)")

        if meta.get("kind") != "warmup" or meta.get("config") != self.config:
            raise bad("it belongs to another run")
        from qlsd_flwr.core.adapt import windows

        wins = windows(rounds)
        for name, top in (("r", rounds), ("w_idx", len(wins))):
            v = meta.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise bad(f"{name} must be an integer in [0, {top}] (got {v!r})")
        g = meta.get("gamma")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < VALUE_MAX):
            raise bad(f"gamma must be a positive number (got {g!r})")
        if not isinstance(meta.get("history"), list) or not all(isinstance(h, dict) for h in meta["history"]):
            raise bad("history is not a list of windows")
        r, w = meta["r"], meta["w_idx"]  # the current window's draws so far: what the warm-up would hold
        held = r - wins[w][0] if w < len(wins) and wins[w][0] <= r else 0
        if a.get("kept") is not None and len(a["kept"]) != held:
            raise bad(f"it holds {len(a['kept'])} draws of the current window, its round {r} means {held}")
        for name, shape in (("theta", (chains, d)), ("kept", (None, chains, d))):
            x = a.get(name)
            if x is None or x.dtype.kind != "f" or x.ndim != len(shape) or \
                    any(s is not None and s != t for s, t in zip(shape, x.shape)) or \
                    not np.all(np.isfinite(x)) or (x.size and float(np.max(np.abs(x))) > VALUE_MAX):
                raise bad(f"array {name!r} is not {' × '.join('n' if s is None else str(s) for s in shape)} finite numbers")
        try:
            metric = from_array(a.get("metric"), d)
        except MetricError as exc:
            raise bad(str(exc)) from None
        if metric.kind != kind:
            raise bad(f"its metric is {metric.kind}, this run's {kind}")
        return {"r": meta["r"], "w_idx": meta["w_idx"], "gamma": float(g), "metric": metric, "theta": a["theta"],
                "kept": list(a["kept"]), "history": meta["history"]}

    def clear(self) -> None:
        for p in (self.path, self.path.parent):
            try:
                p.unlink() if p is self.path else p.rmdir()
            except OSError:  # gone already, or a stray file left in the folder
                pass


def warmup_store(cfg: RunConfig) -> WarmupStore | None:
    """The warm-up's store for a writing run with ``checkpoint-every > 0``, else ``None``."""
    return WarmupStore(cfg) if cfg.checkpoint_every > 0 else None
