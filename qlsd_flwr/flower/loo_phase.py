"""The federated LOO's messages over Flower (the numerics and the rules: :mod:`qlsd_flwr.outputs.loo`).

After the last round the server sends each client one ``query`` message: the ``qlsd`` record
``{"report": "loo", "mode", "reff", "client"}`` and the array ``draws`` (``S × d`` float32, the kept
draws chain by chain: :data:`qlsd_flwr.outputs.loo.DRAWS_DTYPE`). The client answers ``{"client", "status": "ok", "payload": <float64 bytes>}``
(its :func:`qlsd_flwr.outputs.loo.client_reply`) or ``status = "error"`` with the reason.
A reply is attributed to the node it came from, never to the index it claims.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from qlsd_flwr.outputs import loo
from qlsd_flwr.flower.records import ARRAYS, RECORD, config_record


def asker(grid, node_of: dict[int, int], b: int, mode: str, timeout: float):
    """``ask(draws, reff) -> {i: payload}`` for :func:`qlsd_flwr.outputs.loo.attach`."""
    def ask(draws: np.ndarray, reff: float) -> dict:
        arr = Array(np.ascontiguousarray(draws, dtype=loo.DRAWS_DTYPE))
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"report": "loo", "mode": mode, "reff": float(reff),
                                                          "client": i}),
                                    ARRAYS: ArrayRecord({"draws": arr})}), node_of[i], MessageType.QUERY)
                for i in range(b)]
        client_of = {n: i for i, n in node_of.items()}
        out: dict[int, bytes] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            i = client_of.get(msg.metadata.src_node_id)
            if i is None or msg.has_error():
                continue
            try:
                rec = config_record(msg.content)
            except (KeyError, AttributeError, TypeError):
                continue
            if rec.get("status") == "ok" and isinstance(rec.get("payload"), (bytes, bytearray)):
                out[i] = bytes(rec["payload"])
        return out
    return ask


def is_request(rec: dict | None) -> bool:
    return rec is not None and rec.get("report") == "loo"


def answer(pot, content, i: int) -> dict:
    """The client's reply fields to a LOO request (the potential's failure as ``status = "error"``)."""
    try:
        rec = config_record(content)
        draws, mode, reff = content[ARRAYS]["draws"].numpy(), rec["mode"], rec["reff"]
    except (KeyError, TypeError, ValueError) as exc:
        return {"client": i, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"client": i, **loo.reply_fields(pot, mode, draws, reff)}


def after_sampling(strategy, grid) -> None:
    """The LOO of a finished :class:`qlsd_flwr.flower.QLSDStrategy` run (key ``loo``), into its run
    folder's ``samples.nc`` and ``summary.json``; nothing without a run folder."""
    cfg = strategy.cfg
    if strategy.run_dir is None or cfg.get("loo") == "off":
        return
    n_data = [strategy.nodes.n_data.get(i, 1) for i in range(cfg.b)]
    ask = asker(grid, strategy.nodes.node_of, cfg.b, cfg.get("loo"), strategy._timeout)
    loo.attach(strategy.run_dir, cfg.get("loo"), n_data, ask, strategy.server.summary_data,
               ceiling=loo.log_lik_ceiling(cfg))
