"""What a checkpoint must hold before any state is built from it (:func:`validate`), and that it belongs to
the run resuming it (:func:`check_server_parts`, :func:`check_runner_parts`, :func:`check_step_and_metric`):
``CheckpointError`` naming the file and the field. :mod:`qlsd_flwr.outputs.checkpoint` reads and writes."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.config import RunConfig
from qlsd_flwr.errors import CheckpointError

#: the largest magnitude a checkpoint's float may hold (a damaged or crafted state is refused by name)
VALUE_MAX = 1e150
#: a chain's arrays of real numbers (a checkpoint of another dtype was not written by this package)
FLOAT_ARRAYS = ("theta", "zeta", "eta_i", "eta", "theta_star", "claims", "claims_total", "surrogate", "downlink_w")


def check_step_and_metric(cfg: RunConfig, meta: dict, arrays: dict, path) -> None:
    """The checkpoint's γ and metric are those of this configuration, or of the preparation they came from
    (``ts_info``: ``gamma_used``, ``gamma_c``, ``metric_kind``), never numbers taken on trust: a γ of 1e-300 or a
    metric put into an identity-metric run's checkpoint is refused, naming the key."""
    from qlsd_flwr.core.metric import MetricError
    from qlsd_flwr.core.metric_codec import from_array

    metas = [meta] + [m for m in (meta.get("chain_meta") or []) if isinstance(m, dict)]
    run = meta.get("runner") if isinstance(meta.get("runner"), dict) else {}
    metas += [m for m in (run.get("chain_meta") or []) if isinstance(m, dict)]
    ts = meta.get("ts_info") if isinstance(meta.get("ts_info"), dict) else run.get("ts_info") or {}
    chosen = ts.get("gamma_used") if isinstance(ts, dict) else None
    for m in metas:
        if "gamma" not in m:
            continue
        g = m["gamma"]
        if not cfg.gamma_auto and g != float(cfg.gamma):
            raise CheckpointError(f"checkpoint {path}: gamma: its step {g!r} is not the configuration's gamma = "
                                  f"{float(cfg.gamma)!r}")
        if cfg.gamma_auto and chosen is not None and g != chosen:
            raise CheckpointError(f"checkpoint {path}: gamma: its step {g!r} is not the one its preparation chose "
                                  f"(gamma = auto: {chosen!r})")
    if isinstance(ts, dict) and "gamma_c" in ts:  # DG-LMC's client step reads it back: never on trust
        from qlsd_flwr.core.curvature import gamma_c

        c, concave = ts["gamma_c"], ts.get("log_concave", True)  # no log_concave: written when c was a number
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not isinstance(concave, bool) or \
                c != gamma_c(cfg.get("gamma-c"), concave):
            raise CheckpointError(f"checkpoint {path}: gamma-c: its c {c!r} is not the configuration's "
                                  f"(gamma-c = {cfg.get('gamma-c')!r}, log-concave {concave!r})")
    kind = ts.get("metric_kind") if isinstance(ts, dict) else None
    if kind is not None:  # a preparation's chain: the coordinates its clients quantised in are this run's
        from qlsd_flwr.bases import compression_basis

        thetas = [a for n, a in arrays.items() if n.rsplit(".", 1)[-1] == "theta" and getattr(a, "ndim", 0) >= 1]
        now = compression_basis(cfg, int(thetas[0].shape[-1]) if thetas else 0)
        # before 2026-12-06 no checkpoint recorded it, and auto never chose block: such a chain was in θ's coordinates
        was = ts.get("compression_basis", "theta" if now == "block" else now)
        if was != now:
            raise CheckpointError(f"checkpoint {path}: compression-basis: its clients quantised in the {was} basis "
                                  f"and this configuration resolves to {now} (auto picks block for K-FAC with "
                                  "metric-block since 2026-12-06): a different chain; finish it with the version "
                                  "that wrote it, or start the run again")
    plain = cfg.metric == "identity" and not int(cfg.get("metric-rank") or 0) and \
        str(cfg.get("metric-from") or "").strip().lower() != "adapt"
    for name, a in arrays.items():
        if name.rsplit(".", 1)[-1] != "metric":
            continue
        theta = arrays.get(name[:-len("metric")] + "theta")  # the same chain's θ gives d
        try:
            got = None if theta is None else from_array(a, theta.shape[0]).kind
        except MetricError:
            continue  # validate() named it
        if got is not None and ((plain and got != "identity") or (kind is not None and got != kind)):
            want = "identity (metric = identity)" if plain else f"{kind} (its preparation's)"
            raise CheckpointError(f"checkpoint {path}: metric: its array {name!r} holds a {got} metric, the run's is "
                                  f"{want}")


def validate(meta: dict, arrays: dict, path) -> None:
    """Check a checkpoint's contents before any state is built from them (a valid CRC says the
    bytes are those written, not that they are sane): ``CheckpointError`` naming the field."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {why}")

    try:
        k = meta["k"]
        rec = meta["recorder"]
        if not isinstance(meta["config"], dict):
            raise bad("'config' is not a table")
        if not isinstance(rec, dict):
            raise bad("'recorder' is not a table")
        for name, v in (("k", k), *((f"recorder.{f}", rec[f]) for f in ("n_draws", "rounds", "csv_bytes"))):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 2**62:
                raise bad(f"{name} must be an integer >= 0 (got {v!r})")
        if rec["rounds"] > k and meta.get("kind") == "server":
            raise bad(f"recorder.rounds = {rec['rounds']} is past k = {k}")
        if not isinstance(rec["totals"], dict):
            raise bad("recorder.totals is not a table")
    except KeyError as exc:
        raise bad(f"missing field {exc}") from None
    for name, a in arrays.items():
        if a.dtype.kind not in "fiub":  # strings, objects: not a number this package wrote
            raise bad(f"array {name!r} holds {a.dtype} values; a checkpoint holds numbers only")
        if name.rsplit(".", 1)[-1] in FLOAT_ARRAYS and a.dtype.kind != "f":
            raise bad(f"array {name!r} holds {a.dtype} values; expected float64")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise bad(f"array {name!r} has non-finite values")
        if a.dtype.kind == "f" and a.size and float(np.max(np.abs(a))) > VALUE_MAX:
            raise bad(f"array {name!r} holds {float(np.max(np.abs(a))):.3g}, beyond ±{VALUE_MAX:.0e} (no chain "
                      f"state reaches it: the run would stop as run away first)")
        if a.dtype.kind in "iu" and a.size and (int(a.min()) < -2 or int(a.max()) >= 2**62):
            raise bad(f"array {name!r} holds an integer outside [-2, 2^62)")
    for name in ("rejected", "missed_rounds"):
        _check_table(meta.get(name, {}), name, bad)
    for c, m in enumerate(meta.get("chain_meta") or []):
        if isinstance(m, dict):
            for name in ("rejected", "missed_rounds"):
                _check_table(m.get(name, {}), f"chain_meta[{c}].{name}", bad)
    if meta.get("kind") == "server" and not (isinstance(meta.get("ts_info"), dict)
                                             and isinstance(meta.get("rejected"), dict)):
        raise bad("'ts_info' and 'rejected' must be tables")
    if meta.get("kind") == "server" and "chains" in meta:  # a several-chain run (protocol.chains)
        C, metas = meta["chains"], meta.get("chain_meta")
        if isinstance(C, bool) or not isinstance(C, int) or C < 2:
            raise bad(f"chains must be an integer >= 2 (got {C!r})")
        if not isinstance(metas, list) or len(metas) != C or not all(isinstance(m, dict) for m in metas):
            raise bad(f"chain_meta must be a list of {C} tables")
        for c, m in enumerate(metas):
            if m.get("k") != k:
                raise bad(f"chain_meta[{c}].k = {m.get('k')!r}, the checkpoint is at k = {k}")
            _check_server_chain(m, {n[len(f"c{c}."):]: a for n, a in arrays.items() if n.startswith(f"c{c}.")},
                                lambda why, c=c: bad(f"chain {c}: {why}"))
    elif meta.get("kind") == "server":
        _check_server_chain(meta, arrays, bad)
    if meta.get("kind") == "vectorised" and "runner" in meta:  # the rivals' chains' servers (engines.vectorised.rivals)
        metas = (run := meta["runner"] if isinstance(meta["runner"], dict) else {}).get("chain_meta")
        if not isinstance(metas, list) or not metas or not all(isinstance(m, dict) for m in metas):
            raise bad("runner.chain_meta must be a list of tables")
        if not isinstance(run.get("ts_info"), dict):
            raise bad("runner.ts_info must be a table")
        _check_table(run.get("rejected"), "runner.rejected", bad)
        for c, m in enumerate(metas):
            if m.get("k") != k:
                raise bad(f"runner.chain_meta[{c}].k = {m.get('k')!r}, the checkpoint is at k = {k}")
            for name in ("rejected", "missed_rounds"):
                _check_table(m.get(name, {}), f"runner.chain_meta[{c}].{name}", bad)
            _check_server_chain(m, {n[len(f"run_c{c}."):]: a for n, a in arrays.items() if n.startswith(f"run_c{c}.")},
                                lambda why, c=c: bad(f"chain {c}: {why}"))


def check_server_parts(cfg: RunConfig, meta: dict, arrays: dict, path) -> None:
    """What the run ``cfg`` will read from a server checkpoint is there: one chain per
    ``num-chains`` and, for a variant with memory, each chain's ``η_i`` mirrors and ``η``."""
    chains = meta.get("chains", 1)
    if chains != cfg.num_chains:
        raise CheckpointError(f"checkpoint {path}: it holds {chains} chain(s), the run has num-chains = "
                              f"{cfg.num_chains}")
    prefixes = [""] if chains == 1 else [f"c{c}." for c in range(chains)]
    need = ("theta", "eta_i", "eta") if cfg.memory else ("theta",)
    for pre in prefixes:
        for name in need:
            if pre + name not in arrays:
                raise CheckpointError(f"checkpoint {path}: array {pre + name!r} is missing")


def check_runner_parts(cfg: RunConfig, meta: dict, arrays: dict, path) -> None:
    """A rival's vectorised checkpoint: a server state per chain, ``b`` clients each, the claims at θ*."""
    metas = meta["runner"].get("chain_meta") if isinstance(meta.get("runner"), dict) else None
    if not isinstance(metas, list) or len(metas) != cfg.num_chains:
        raise CheckpointError(f"checkpoint {path}: 'runner' must hold {cfg.num_chains} chain(s) (num-chains)")
    for c in range(cfg.num_chains):
        acked = arrays.get(f"run_c{c}.anchor_acked")
        if acked is None or acked.shape != (cfg.b,):
            raise CheckpointError(f"checkpoint {path}: chain {c}: array 'anchor_acked' must hold num-clients = {cfg.b}")
        if cfg.kind.at_theta_star and f"run_c{c}.claims" not in arrays:
            raise CheckpointError(f"checkpoint {path}: chain {c}: the claims at θ* ('claims') are missing")


def _check_table(t, name: str, bad) -> None:
    """``rejected`` ({reason: count}) and ``missed_rounds`` ({client: [rounds]}) as written."""
    if not isinstance(t, dict):
        raise bad(f"{name!r} must be a table")
    for k, v in t.items():
        if name.endswith("rejected"):
            ok = isinstance(k, str) and _small_int(v)
        else:
            ok = isinstance(k, str) and k.isdigit() and isinstance(v, list) and all(_small_int(r) for r in v)
        if not ok:
            raise bad(f"{name!r} holds {k!r}: {str(v)[:40]!r}, not a "
                      f"{'count' if name.endswith('rejected') else 'list of rounds of a client index'}")


def _small_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and 0 <= v < 2**62


def _check_server_chain(meta: dict, arrays: dict, bad) -> None:
    """One chain's fields in a server checkpoint (:meth:`QLSDServer.snapshot`)."""
    zv = meta.get("zeta_version")
    if isinstance(zv, bool) or not isinstance(zv, int) or not -1 <= zv < 2**62:
        raise bad(f"zeta_version must be an integer in [-1, 2^62) (got {zv!r})")
    if not isinstance(meta.get("rejected"), dict) or not isinstance(meta.get("missed_rounds"), dict):
        raise bad("'rejected' and 'missed_rounds' must be tables")
    theta = arrays.get("theta")
    if theta is None or theta.ndim != 1:
        raise bad("array 'theta' must be one vector")
    d = theta.shape[0]
    for name in ("anchor_acked", "eta_count", "needs_resync"):
        if name not in arrays or arrays[name].ndim != 1:
            raise bad(f"array {name!r} missing or not one vector")
    b = arrays["anchor_acked"].shape[0]
    for name, shape in (("eta_count", (b,)), ("needs_resync", (b,)), ("eta_i", (b, d)), ("eta", (d,)),
                        ("zeta", (d,)), ("theta_star", (d,))):
        if name in arrays and arrays[name].shape != shape:
            raise bad(f"array {name!r} has shape {arrays[name].shape}, expected {shape}")
    metric_array = arrays.get("metric")
    if metric_array is not None:
        from qlsd_flwr.core.metric import MetricError
        from qlsd_flwr.core.metric_codec import from_array

        try:
            from_array(metric_array, d)
        except MetricError as exc:
            raise bad(f"array 'metric': {exc}") from None
    g = meta.get("gamma", 1.0)
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < float("inf")):
        raise bad(f"gamma must be a positive finite number (got {g!r})")
