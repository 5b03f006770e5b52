"""A thin adapter for apps still on Flower's legacy API (``flwr.server.strategy.Strategy`` with
a ``NumPyClient``). It runs the same round protocol (:class:`~qlsd_flwr.protocol.server.QLSDServer`,
:func:`qlsd_flwr.protocol.client.handle`) and gives the same chain as the Message-API strategy.

What the compatibility layer allows, and how it is mapped:

* per-client payloads: ``configure_fit`` returns one ``FitIns`` per active client, its config
  carrying the same fields as the Message API (bytes values are allowed in legacy configs);
* client identity: the server only sees ``ClientProxy.cid`` (a node id), so the first round
  asks each proxy for its ``partition-id`` with ``get_properties``;
* per-client state: a ``NumPyClient`` is rebuilt for every message; it keeps its state in the
  ``context.state`` of the ``client_fn`` that built it;
* the reply's encoded message travels in the ``FitRes`` metrics (bytes scalars);
* limits: the legacy round loop cannot run the θ* optimisation phase with its own message
  type, so QLSD* needs ``theta-star = closed-form`` here, and rounds are driven by Flower's
  ``ServerConfig(num_rounds)`` (one fit round = one Langevin step);
* the federated LOO (key ``loo``, :mod:`qlsd_flwr.outputs.loo`) is the last round's evaluate step:
  ``EvaluateIns`` carries the kept draws as its parameters and ``{"report": "loo", "mode", "reff"}``
  as its config; each client's ``EvaluateRes`` metrics carry its reply, as the Message API's
  ``query`` does.
"""

from __future__ import annotations

from flwr.common import (
    EvaluateIns,
    FitIns,
    GetPropertiesIns,
    Parameters,
    ndarrays_to_parameters,
)
from flwr.server.strategy import Strategy as LegacyStrategy

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol import precondition
from qlsd_flwr.flower.client_app import (
    load_state,
    run_config_of,
    save_state,
    setup_for_config,
)
from qlsd_flwr.outputs import loo
from qlsd_flwr.outputs.observer import RunOutputs
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.client import handle
from qlsd_flwr.protocol.server import QLSDServer
from qlsd_flwr.protocol.wire import vectors_to_bytes


class LegacyQLSDStrategy(LegacyStrategy):
    """QLSD family on ``flwr.server.strategy.Strategy`` (see module docstring)."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True, keep_trace: bool = False):
        if cfg.num_chains > 1:
            raise ConfigError(f"num-chains = {cfg.num_chains}: the legacy strategy runs one chain; use the "
                              "Message-API strategy (engine = ray or inprocess) for several chains in one run")
        if build.downlink_on(cfg):  # Flower's legacy fit sends θ as its Parameters whatever the fields say
            raise ConfigError("downlink: the legacy strategy sends θ in full as Flower's Parameters every round; use "
                              "the Message-API strategy (engine = ray or inprocess) for downlink = qsgd")
        if cfg.kind.at_theta_star:
            raise ConfigError(f"variant: {cfg.variant} needs every client's ∇U_i(θ*) (and fsgld their curvature) "
                              "before sampling, which the legacy round loop cannot ask; use the Message-API strategy "
                              "(engine = ray or inprocess), or variant = fald")
        # no message type reaches the clients before sampling: θ* in closed form, metric from a file
        prep = precondition.prepare(cfg, task, build.theta0_of(task), grad_fn=None, curv_fn=None)
        self.server = QLSDServer(cfg, task, keep_trace, "flower-legacy",
                                 observer=RunOutputs(cfg, task.dim, run_dir) if write else None)
        self.server.begin(prep.theta_star, prep.info, None, prep)
        self.cfg, self.task = self.server.cfg, task
        self.index_of: dict[str, int] = {}
        self.rounds_done = 0

    def initialize_parameters(self, client_manager) -> Parameters:
        return ndarrays_to_parameters([self.server.state.theta])

    def _map_clients(self, client_manager, server_round: int) -> None:
        client_manager.wait_for(self.cfg.b)
        for proxy in client_manager.all().values():
            if proxy.cid not in self.index_of:
                res = proxy.get_properties(GetPropertiesIns({}), timeout=600, group_id=str(server_round))
                self.index_of[proxy.cid] = int(res.properties["partition-id"])

    def configure_fit(self, server_round, parameters, client_manager):
        self._map_clients(client_manager, server_round)
        proxy_of = {i: p for p in client_manager.all().values() if (i := self.index_of.get(p.cid)) is not None}
        return [(proxy_of[i], FitIns(parameters, vectors_to_bytes(self.server.fields_for(i))))
                for i in self.server.begin_round()]

    def aggregate_fit(self, server_round, results, failures):
        for proxy, fit_res in results:
            self.server.accept(self.index_of.get(proxy.cid), dict(fit_res.metrics))
        for failure in failures:
            proxy = failure[0] if isinstance(failure, tuple) else None
            self.server.accept(self.index_of.get(proxy.cid) if proxy else None, None, error=str(failure))
        row = self.server.end_round()
        self.rounds_done += 1
        if self.rounds_done == self.cfg.num_rounds:
            self.server.finish()
        return ndarrays_to_parameters([self.server.state.theta]), {k: float(v) for k, v in row.items()}

    def _loo_due(self) -> bool:
        return self.rounds_done == self.cfg.num_rounds and self.server.run_dir is not None \
            and self.cfg.get("loo") != "off"

    def configure_evaluate(self, server_round, parameters, client_manager) -> list[tuple]:
        """After the last round: the federated LOO's request to every client (module docstring)."""
        if not self._loo_due():
            return []
        try:
            draws, reff, _ = loo.request(self.server.run_dir / "samples.nc")
        except loo.LooError:  # nothing to send (too few draws, too many bytes): attach records why
            self._attach({})
            return []
        ins = EvaluateIns(ndarrays_to_parameters([draws]), {"report": "loo", "mode": str(self.cfg.get("loo")),
                                                            "reff": float(reff)})
        return [(p, ins) for p in client_manager.all().values() if p.cid in self.index_of]

    def aggregate_evaluate(self, server_round, results, failures):
        if self._loo_due():
            self._attach({self.index_of[proxy.cid]: bytes(res.metrics["payload"]) for proxy, res in results
                          if proxy.cid in self.index_of and isinstance(res.metrics.get("payload"), (bytes, bytearray))})
        return None, {}

    def _attach(self, got: dict) -> None:
        """:func:`qlsd_flwr.outputs.loo.attach` with the replies ``got`` (asked in configure_evaluate)."""
        loo.attach(self.server.run_dir, self.cfg.get("loo"), self.task.n_data, lambda draws, reff: got,
                   self.server.summary_data, ceiling=loo.log_lik_ceiling(self.cfg))

    def evaluate(self, server_round, parameters):
        return None


def make_numpy_client_fn(overrides: dict | None = None):
    """A ``client_fn(context)`` building the legacy ``NumPyClient`` for the same core."""
    from flwr.client import NumPyClient

    class QLSDNumPyClient(NumPyClient):
        def __init__(self, context):
            self.context = context
            self.index = int(context.node_config["partition-id"])

        def get_properties(self, config):
            return {"partition-id": self.index}

        def fit(self, parameters, config):
            cfg, pot, spec, d = setup_for_config(run_config_of(self.context, overrides), self.index)
            st = load_state(self.context)
            reply = handle(spec, pot, st, cfg.seed, dict(config), d)
            save_state(self.context, st, d)
            return [], int(pot.n_data), reply

        def evaluate(self, parameters, config):
            if config.get("report") != "loo":
                return 0.0, 0, {}
            _, pot, _, _ = setup_for_config(run_config_of(self.context, overrides), self.index)
            draws = parameters[0] if len(parameters) == 1 else None  # the same reply as the Message API's
            return 0.0, int(pot.n_data), loo.reply_fields(pot, config.get("mode"), draws, config.get("reff"))

    return lambda context: QLSDNumPyClient(context).to_client()
