"""The exchanges before sampling on the Flower path: the θ* descent's gradients and the curvature
reports, each reply attributed to the node it came from and checked before it is used.

One unusable reply (a wrong length, a non-finite value, an error, no reply in time) must neither
stop the run nor enter ``∇U``. It is counted (``rejected['phase_reply']`` in ``summary.json``) and
the client is asked again at once. Still unusable, the descent takes the last term the client gave
(a descent tolerates a stale term; θ* is checked again at its end); a client with no usable term
yet, or unusable :data:`STREAK` times in a row, is **left out of the run**: not asked again, in
``summary.json``'s ``excluded`` (round 0), and the chain samples the posterior of the other clients'
data, as after the norm guard excludes one (``docs/DEPLOYMENT.md`` §9b). The claims at θ*
(:mod:`qlsd_flwr.protocol.claims`) take no stale term. The run stops only when no client is left.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Message, MessageType

from qlsd_flwr.flower.records import record_fields, to_content
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.wire import PhaseError, gradient_of

log = logging.getLogger("qlsd_flwr")

#: a client unusable this many exchanges in a row is left out
STREAK = 3


class PhaseExchanges:
    """The phases before sampling of one strategy (module docstring); ``left_out`` and
    ``rejected`` are what the server records once sampling begins."""

    def __init__(self, cfg, task, nodes, settings):
        self.cfg, self.task, self.nodes, self.settings = cfg, task, nodes, settings
        self.d = task.dim
        self.left_out: dict[int, str] = {}  # client -> why
        self.rejected = 0
        self._last: dict[int, np.ndarray] = {}
        self._streak: dict[int, int] = {}

    def clients(self) -> list[int]:
        return [i for i in range(self.cfg.b) if i not in self.left_out]

    def ask(self, grid, fields: dict, timeout: float, clients: list[int]) -> dict[int, bytes]:
        """Send ``fields`` (with ``client = i``) to ``clients``; ``{i: payload}`` of the replies,
        each attributed to the node it came from (never to the index it claims)."""
        msgs = [Message(to_content({**fields, "client": i}, self.settings[i]), self.nodes.node_of[i],
                        MessageType.TRAIN) for i in clients]
        client_of = {self.nodes.node_of[i]: i for i in clients}
        out: dict[int, bytes] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            i = client_of.get(msg.metadata.src_node_id)
            if i is None or msg.has_error():
                continue
            rec = record_fields(msg.content) or {}
            if isinstance(rec.get("payload"), (bytes, bytearray)):
                out[i] = bytes(rec["payload"])
        return out

    def _usable(self, grid, theta, timeout, clients) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """Every client's ``∇U_i(θ)``, the unusable ones asked once more; ``(grads, why refused)``."""
        grads: dict[int, np.ndarray] = {}
        refused: dict[int, str] = {}
        for attempt in range(2):
            want = clients if attempt == 0 else sorted(refused)
            if not want:
                break
            got = self.ask(grid, {"phase": "grad", "round": -1, "theta": theta}, timeout, want)
            for i in want:
                if i not in got:
                    refused[i] = "no reply"
                    continue
                try:
                    grads[i] = gradient_of(got[i], self.d)
                    refused.pop(i, None)
                except ValueError as exc:
                    refused[i] = str(exc)
            self.rejected += len(refused)
        return grads, refused

    def _leave_out(self, i: int, why: str) -> None:
        self.left_out[i] = why
        log.warning("client %d: no usable gradient before sampling (%s): left out of the run; the chain samples the "
                    "posterior of the other clients' data (summary.json 'excluded')", i, why)
        if not self.clients():
            raise PhaseError("optimisation phase: no usable gradient from any client ("
                             + ", ".join(f"{j}: {w}" for j, w in sorted(self.left_out.items())) + ")")

    def gradients(self, grid, theta: np.ndarray, timeout: float, stale: bool = True) -> list[np.ndarray]:
        """The kept clients' ``∇U_i(θ)`` in client order (zeros for those left out); ``stale``: a
        client unusable after the second ask gives its last term (the descent), else it is left out."""
        grads, refused = self._usable(grid, theta, timeout, self.clients())
        for i, why in sorted(refused.items()):
            self._streak[i] = self._streak.get(i, 0) + 1
            if stale and i in self._last and self._streak[i] < STREAK:
                grads[i] = self._last[i]
            else:
                self._leave_out(i, why)
        for i in grads:
            if i not in refused:
                self._streak[i], self._last[i] = 0, grads[i]
        return [grads[i] if i in grads and i not in self.left_out else np.zeros(self.d) for i in range(self.cfg.b)]

    def full_grad(self, grid, theta: np.ndarray, timeout: float) -> np.ndarray:
        """``∇U(θ)`` of the clients kept (the θ* optimisation phase)."""
        return build.combine_grads(self.cfg, self.task.prior, self.gradients(grid, theta, timeout), theta)

    def curvature(self, grid, theta: np.ndarray, kind: str, timeout: float) -> dict[int, np.ndarray]:
        """The kept clients' curvature reports at ``θ``, as received:
        :func:`qlsd_flwr.core.precondition.prepare` validates each."""
        got = self.ask(grid, {"phase": "curvature", "round": -1, "theta": theta, "kind": kind}, timeout,
                       self.clients())
        return {i: (np.frombuffer(b, dtype="<f8") if len(b) % 8 == 0 else b) for i, b in got.items()}
