"""The Flower ``ClientApp``: decodes θ, calls the core, encodes the reply. No numerics here.

:func:`make_client_app` is the public client side. Give it ``potential_fn(context) -> potential``
(your model and this node's data, as a :class:`~qlsd_flwr.core.potential.LocalPotential`; see
:mod:`qlsd_flwr.potentials` for numpy, torch and log-density adapters) and it handles the whole
protocol; without one, it builds the run config's task (the app of ``pyproject.toml``).

* ``query``  — handshake: which client index (``partition-id`` of the node config) this node
  is, its ``N_i`` and ``d``; with ``report = "memory"`` also its own η_i and update count
  (the end-of-run check that ``η = Σ_i η_i``).
* ``train``  — ``phase = "sample"``: one round of :func:`qlsd_flwr.core.oracles.client_round`, the
  reply carrying the encoded compressed message; ``phase = "grad"``: the full local
  gradient ``∇U_i(θ)`` for the optimisation phase that finds θ*. ``θ`` comes in an
  ``ArrayRecord``, the client's settings (oracle, ``s_i``, ``α_i``, …) beside it
  (:mod:`qlsd_flwr.flower.records`), so a client needs no run config of its own.

Per-client state (η_i, its update count, the anchor ζ or θ*, and ``∇U_i(ζ)``) lives in
``context.state`` and survives across rounds; a node that lost it answers ``resync`` and is
brought back by the server (:mod:`qlsd_flwr.protocol.wire`).

Node config (``flower-supernode --node-config``): ``partition-id`` (required, the client
index ``i``; Flower's simulation engine sets it), ``num-partitions`` (informative) and optionally
``data-path``, an ``.npz`` file with this node's own partition (see
:func:`qlsd_flwr.tasks.loading.load_partition`); without it the node builds partition ``i`` itself
(the Gaussian task generates it from its keys).
"""

from __future__ import annotations

import functools
import json
from typing import Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from qlsd_flwr.config import resolve
from qlsd_flwr.core.oracles import ClientState
from qlsd_flwr.core.downlink import support_to_bytes
from qlsd_flwr.core.potential import LocalPotential, declared_support, declares_log_concave
from qlsd_flwr.flower import loo_phase
from qlsd_flwr.outputs.resume import flwr_run_config
from qlsd_flwr.flower.records import (
    RECORD,
    SETTINGS,
    config_record,
    from_content,
    record_fields,
)
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.client import handle, handle_chains
from qlsd_flwr.protocol.memory_audit import digest
from qlsd_flwr.samplers.fields import HELD
from qlsd_flwr.protocol.wire import arr_to_bytes, bytes_to_arr, metric_of, metric_to_bytes
from qlsd_flwr.tasks import loading
from qlsd_flwr.tasks.threads import apply_threads

STATE = "qlsd-state"
#: the metric (or ``compression-basis = block``'s basis) a node's chains share, kept once a node: Flower's Ray engine
#: ships a client's whole ``Context`` to its actor and back with every message, and the main job's basis is 0.70 MB
METRIC = "qlsd-metric"
#: the ``metric-block`` directions a node received, kept until ``compression-basis = block``'s basis is built from
#: them (it may come by reference, core.block_basis.BasisRef), then dropped
BLOCK_DIRS = "qlsd-block-dirs"


@functools.lru_cache(maxsize=4096)  # one entry per client this process hosts (Ray: many)
def setup_for_config(cfg_json: str, i: int, data_path: str | None = None):
    """``(cfg, potential, spec, d)`` of client ``i`` under the run config ``cfg_json`` (JSON),
    built once per config and client in each process."""
    cfg = resolve(json.loads(cfg_json))
    pot, prior, d, blocks = loading.load_client(cfg, i, data_path=data_path)
    apply_threads(cfg.raw)  # after the potential: a torch task has imported torch by now
    spec = build.client_spec(cfg, i, pot.n_data, d, prior, blocks)
    return cfg, pot, spec, d


_CFG_JSON: dict = {}  # run config items (hashable) -> its JSON: one json.dumps per config, not per message


def client_setup(context: Context, overrides: dict | None, overrides_json: str):
    """``(cfg, potential, spec, d)`` of this node's client, built once per run config."""
    try:
        items = frozenset(context.run_config.items())
        cfg_json = _CFG_JSON.get((items, overrides_json))
        if cfg_json is None:
            cfg_json = _CFG_JSON[(items, overrides_json)] = run_config_of(context, overrides)
    except TypeError:  # an unhashable value: the JSON itself is the key
        cfg_json = run_config_of(context, overrides)
    return setup_for_config(cfg_json, client_index(context), data_path_of(context))


def client_index(context: Context) -> int:
    try:
        return int(context.node_config["partition-id"])
    except KeyError as exc:
        raise KeyError("node config lacks 'partition-id' (start the SuperNode with "
                       "--node-config 'partition-id=<i> num-partitions=<b>')") from exc


def data_path_of(context: Context) -> str | None:
    path = context.node_config.get("data-path")
    return str(path) if path not in (None, "") else None


def state_key(chain: int | None) -> str:
    """The ``context.state`` record of a chain's client state: ``qlsd-state`` for a one-chain run,
    ``qlsd-state.<c>`` for chain ``c`` of a several-chain run."""
    return STATE if chain is None else f"{STATE}.{int(chain)}"


def load_state(context: Context, chain: int | None = None) -> ClientState:
    st = ClientState()
    try:
        rec = config_record(context.state, state_key(chain))
    except KeyError:  # a chain's first message: only what the node holds for all its chains (the basis another
        _load_dirs(context, st)  # chain built, which a reference to it then finds: protocol.client)
        node = config_record(context.state, METRIC) if METRIC in context.state else {}
        if "dim" in node:
            st.metric = metric_of(node["metric"], int(node["dim"]))
        return st
    d = int(rec["dim"])
    st.eta_count = int(rec.get("eta_count", 0))
    st.anchor_version = int(rec.get("anchor_version", -1))
    st.w_round = int(rec.get("w_round", -1))  # downlink = qsgd: the round of the w it holds
    st.point_id = int(rec.get("point_id", -1))  # before sampling: the number of the point it holds
    for name in HELD:  # the vectors a client keeps (qlsd_flwr.samplers.fields)
        if name in rec:
            setattr(st, name, bytes_to_arr(rec[name], d))
    held = config_record(context.state, METRIC) if METRIC in context.state else rec  # rec: written before METRIC
    if "metric" in held:  # the metric as it travelled (protocol.wire.metric_to_bytes)
        st.metric = metric_of(held["metric"], d)
    _load_dirs(context, st)
    return st


def _load_dirs(context: Context, st: ClientState) -> None:
    if BLOCK_DIRS in context.state:
        rec = config_record(context.state, BLOCK_DIRS)
        st.block_dirs = bytes_to_arr(rec["rows"], len(rec["rows"]) // 8).reshape(-1, int(rec["dim"]))


def save_state(context: Context, st: ClientState, d: int, chain: int | None = None) -> None:
    rec = ConfigRecord({"dim": d, "eta_count": st.eta_count, "anchor_version": st.anchor_version,
                        "w_round": st.w_round, "point_id": st.point_id})
    for name in HELD:
        val = getattr(st, name)
        if val is not None:
            rec[name] = arr_to_bytes(val)
    if st.metric is not None and not _holds(context, st.metric, d):
        context.state[METRIC] = ConfigRecord({"metric": metric_to_bytes(st.metric), "dim": d})
    if st.block_dirs is None:  # the basis built, or never to come (protocol.client): not shipped with every message
        if BLOCK_DIRS in context.state:
            del context.state[BLOCK_DIRS]
    elif BLOCK_DIRS not in context.state:
        context.state[BLOCK_DIRS] = ConfigRecord({"rows": arr_to_bytes(st.block_dirs.ravel()), "dim": d})
    context.state[state_key(chain)] = rec


def _holds(context: Context, metric, d: int) -> bool:
    """Whether ``context.state`` already holds ``metric``'s bytes: :func:`metric_of` keeps the metric it last read, so
    the one every chain loaded from them is the same object, and is not encoded again at each message."""
    if METRIC not in context.state:
        return False
    try:
        return metric_of(config_record(context.state, METRIC)["metric"], d) is metric
    except (KeyError, ValueError):
        return False


def held_chains(context: Context) -> list[int]:
    """The chains of a several-chain run whose state this node holds."""
    head = STATE + "."
    return sorted(int(k[len(head):]) for k in context.state if k.startswith(head) and k[len(head):].isdigit())


def run_config_of(context: Context, overrides: dict | None) -> str:
    merged = flwr_run_config({**dict(context.run_config), **(overrides or {})}, where="client")
    return json.dumps(merged, sort_keys=True, default=str)


def _reply(message: Message, fields: dict) -> Message:
    return Message(RecordDict({RECORD: ConfigRecord(fields)}), reply_to=message)


@functools.lru_cache(maxsize=4096)
def _spec(settings_items: tuple, i: int, n_data: int, d: int):
    return build.client_spec_from_settings(dict(settings_items), i, n_data, d)


def check_potential(pot, where: str) -> LocalPotential:
    """``pot`` if it has what a client needs (``n_data``, ``dim``, ``grad_sum``, ``value``);
    ``TypeError`` naming what is missing otherwise."""
    missing = [a for a in ("n_data", "dim", "grad_sum", "value") if not hasattr(pot, a)]
    if missing:
        raise TypeError(f"{where} returned {type(pot).__name__}, which lacks {', '.join(missing)} (a "
                        "LocalPotential has n_data, dim, grad_sum(theta, idx) and value(theta); see "
                        "qlsd_flwr.potentials)")
    return pot


def make_client_app(potential_fn: Callable[[Context], LocalPotential] | None = None, *,
                    overrides: dict | None = None, mods=None) -> ClientApp:
    """The QLSD ``ClientApp``.

    Parameters
    ----------
    potential_fn : callable, optional
        ``potential_fn(context) -> LocalPotential``: this node's local potential
        ``U_i(θ) = Σ_j U_ij(θ)`` (its data and your model), for example a
        :class:`qlsd_flwr.potentials.TorchPotential` on the partition
        ``context.node_config["partition-id"]``. Called once per run and node; the result is
        kept. Without it, the app builds the run config's task (``task``, ``dataset``, …).
    overrides : dict, optional
        Run-config values laid over ``context.run_config`` (the built-in task only).
    mods : list, optional
        Flower client mods.

    Returns
    -------
    flwr.clientapp.ClientApp
        Answers the handshake and memory-report queries and the sampling and gradient rounds of
        :class:`qlsd_flwr.flower.QLSDStrategy`, keeping the client's state in ``context.state``.
    """
    app = ClientApp(mods=mods or [])
    overrides_json = json.dumps(overrides or {}, sort_keys=True, default=str)
    potentials: dict = {}  # (run id, partition id) -> the user's potential, made once

    def potential_of(context: Context):
        """``(potential, d, cfg or None)`` of this node."""
        if potential_fn is None:
            cfg, pot, _, d = client_setup(context, overrides, overrides_json)
            return pot, d, cfg
        key = (context.run_id, client_index(context))
        if key not in potentials:
            potentials[key] = check_potential(potential_fn(context), "potential_fn")
            apply_threads({**dict(context.run_config), **(overrides or {})})
        pot = potentials[key]
        return pot, int(pot.dim), None

    @app.query()
    def query(message: Message, context: Context) -> Message:
        i = client_index(context)
        pot, d, cfg = potential_of(context)
        # log_concave: the server's gamma-c = auto takes the log-concave step only if every client says so
        fields = {"client": i, "n_data": int(pot.n_data), "dim": int(d), "log_concave": declares_log_concave(pot)}
        rec = record_fields(message.content)
        if loo_phase.is_request(rec):  # after sampling: this client's part of the federated LOO
            return _reply(message, loo_phase.answer(pot, message.content, i))
        if rec is not None and rec.get("report") in ("memory", "memory-digest"):
            # the audit asks for digests first, the vectors only where a digest differs (protocol.memory_audit)
            name, enc = ("eta_digest", digest) if rec["report"] == "memory-digest" else \
                ("eta", lambda e: b"" if e is None else arr_to_bytes(e))
            if chains := held_chains(context):  # a several-chain run: one entry a chain
                sts = [load_state(context, c) for c in chains]
                fields.update({"chains": chains, "eta_count": [int(st.eta_count) for st in sts],
                               name: [enc(st.eta) for st in sts]})
            else:
                st = load_state(context)
                fields["eta_count"] = int(st.eta_count)
                if st.eta is not None:
                    fields[name] = enc(st.eta)
        elif cfg is None or build.support_on(cfg):  # the handshake: the coordinates its gradient reads, where the
            if (live := declared_support(pot, d)) is not None:  # broadcast codes their union (downlink-support)
                fields["support"] = support_to_bytes(live, d)
        return _reply(message, fields)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        pot, d, cfg = potential_of(context)
        fields, settings = from_content(message.content)
        i = client_index(context)
        # the settings come with the first message to a node (and after a resync); kept in its state
        if settings is not None:
            context.state[SETTINGS] = ConfigRecord(settings)
        elif SETTINGS in context.state:
            settings = dict(context.state[SETTINGS])
        if settings is not None:
            spec, seed = _spec(tuple(sorted(settings.items())), i, int(pot.n_data), d)
        elif cfg is not None:  # the project's own app: the run config gives the same settings
            spec, seed = client_setup(context, overrides, overrides_json)[2], cfg.seed
        else:  # state lost (a restarted node): ask for the settings, the anchor and the mirror
            return _reply(message, {"client": i, "status": "resync"})
        if "chains" in fields:  # several chains: chain c with its own state and seed + c
            reply, states = handle_chains(spec, pot, lambda c: load_state(context, c), seed, fields, d)
            for c, st in states.items():
                save_state(context, st, d, c)
            return _reply(message, reply)
        st = load_state(context)
        reply = handle(spec, pot, st, seed, fields, d)
        save_state(context, st, d)
        return _reply(message, reply)

    return app


app = make_client_app()
