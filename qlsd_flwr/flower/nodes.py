"""Node management: which Flower node runs client ``i``, and what each node reports about itself.

The round protocol addresses clients by index ``i`` (the node config's ``partition-id``); Flower
addresses nodes by id. :class:`NodeRegistry` keeps the map: a handshake before the first round
(every node answers a ``QUERY`` with its ``client`` index and ``dim``), the re-mapping of nodes
that join later (a restarted SuperNode), and the end-of-run query of each client's own memory
term for the memory audit (:meth:`~qlsd_flwr.protocol.server.QLSDServer.memory_check`).
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from qlsd_flwr.core.downlink import support_from_bytes
from qlsd_flwr.robust import handshake
from qlsd_flwr.flower.records import RECORD, config_record
from qlsd_flwr.protocol import memory_audit
from qlsd_flwr.protocol.wire import memory_digests, memory_report

log = logging.getLogger("qlsd_flwr")


SIMULATION_GRACE = 10.0  # seconds a short node count may stay unchanged on the simulation engine
PROBE_TIMEOUT = 10.0  # seconds to wait for a client's node before another may take its place
REASK_ROUNDS = 20  # rounds before a refused node is asked again
#: the least the end-of-run memory audit waits for its replies (seconds): it is one exchange, in which every node
#: starts a ClientApp process at once. On a busy 2-core machine (CI, 2026-12-03) a test with reply-timeout = 20 read
#: no client, though the three nodes' logs show their replies sent and the SuperLink received them
AUDIT_WAIT = 60.0


class HandshakeError(RuntimeError):
    """The expected clients did not all announce themselves."""


def _hello(node: int, **extra) -> Message:
    return Message(RecordDict({RECORD: ConfigRecord({"hello": 1, **extra})}), node, MessageType.QUERY)


def normalise_key(data: bytes) -> bytes | None:
    """A public key (PEM, OpenSSH or DER) as DER SubjectPublicKeyInfo bytes; ``None`` if unreadable."""
    from cryptography.hazmat.primitives import serialization as ser

    for load in (ser.load_pem_public_key, ser.load_ssh_public_key, ser.load_der_public_key):
        try:
            key = load(data)
        except Exception:  # noqa: BLE001 — try the next format
            continue
        return key.public_bytes(ser.Encoding.DER, ser.PublicFormat.SubjectPublicKeyInfo)
    return None


def load_bound_keys(folder: str, b: int) -> dict[int, bytes]:
    """``node-keys``: client ``i``'s node must have registered ``<folder>/node<i>.pub`` (what
    ``python -m qlsd_flwr.deploy node-key <folder> node<i>`` writes); ``ValueError`` naming a
    missing or unreadable file."""
    from pathlib import Path

    out = {}
    for i in range(b):
        path = Path(folder) / f"node{i}.pub"
        try:
            key = normalise_key(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"node-keys: {path}: {exc.strerror or exc}") from None
        if key is None:
            raise ValueError(f"node-keys: {path} is not a public key (PEM or OpenSSH)")
        out[i] = key
    return out


class NodeRegistry:
    """The map client index ``i`` → Flower node id for ``b`` clients of dimension ``d``."""

    def __init__(self, b: int, d: int, bound_keys: dict[int, bytes] | None = None):
        self.b, self.d = b, d
        # client i -> the DER public key its node must have registered with (node authentication)
        self.bound_keys = bound_keys or {}
        self._keys_seen: dict[int, bytes | None] = {}  # node id -> its registered key (DER)
        self._refused_at: dict[int, int] = {}  # refused node id -> the round it was refused in
        self.node_of: dict[int, int] = {}
        self._foreign: set[int] = set()  # node ids that are none of our clients (or dead ones)
        self.rejoined: dict[int, list[int]] = {}  # client -> rounds it came back as a new node
        self.refused_claims: dict[int, list[int]] = {}  # client -> nodes refused its partition-id
        self.n_data: dict[int, int] = {}  # client -> N_i its node claimed at the handshake
        self._claimed_n: dict[int, int] = {}  # node -> the N_i it claimed
        self._concave: dict[int, bool] = {}  # node -> it declared its potential log-concave
        self.log_concave: dict[int, bool] = {}  # client -> as its node declared (gamma-c = auto)
        self._failed: dict[int, str] = {}  # node -> the error it answered the handshake with
        self._support: dict[int, object] = {}  # node -> the support it declared (None: every coordinate)
        self.support: dict[int, object] = {}  # client -> as its node declared (downlink-support = data)

    def handshake(self, grid: Grid, timeout: float) -> None:
        """Wait for the ``b`` clients and map client index → node id (``partition-id``).

        Says at once what it waits for (``waiting for 20 client nodes, 2 connected``), again
        when the count changes. On Flower's simulation engine (a grid that polls in process)
        every SuperNode exists from the start, so a count that stays short for
        :data:`SIMULATION_GRACE` seconds fails at once, with the command that sets the
        federation's size; a deployment waits up to ``timeout`` (``reply-timeout``) for
        SuperNodes that start later."""
        b = self.b
        start = time.time()
        # every node of a simulation (Flower's engine polls in process; the in-process grid) exists from the start
        simulation = getattr(grid, "pull_interval", None) is not None or getattr(grid, "all_nodes_at_start", False)
        said, changed = -1, start
        while len(nodes := list(grid.get_node_ids())) < b:
            now = time.time()
            if len(nodes) != said:
                log.warning("waiting for %d client nodes, %d connected", b, len(nodes))
                said, changed = len(nodes), now
            if simulation and now - changed > SIMULATION_GRACE:
                raise HandshakeError(
                    f"num-clients = {b} but the simulation has {len(nodes)} SuperNodes: set the "
                    f"federation's size with `flwr federation simulation-config <federation> "
                    f"--num-supernodes {b}`, or run with num-clients = {len(nodes)}")
            if now - start > timeout:
                raise HandshakeError(f"expected {b} client nodes, only {len(nodes)} connected after "
                                     f"{timeout:.0f} s (check num-clients and that every SuperNode is up, "
                                     f"each with --node-config 'partition-id=<i> num-partitions={b}'; "
                                     f"the wait is reply-timeout)")
            time.sleep(0.2)
        claims: dict[int, dict[int, str | None]] = {}  # client -> {node: None (consistent) or why not}
        asked: set[int] = set()
        while True:
            self._ask(grid, [n for n in nodes if n not in asked], timeout, claims)
            asked |= set(nodes)
            seen, conflicts = self._settle(claims)
            missing = sorted(set(range(b)) - set(seen) - set(conflicts))
            # a refused node may have filled the count before a rightful one came up: a deployment
            # waits for it within reply-timeout; a simulation has no one else to wait for
            if not missing and not conflicts or simulation or time.time() - start > timeout:
                break
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if conflicts:
            i, nodes_ = min(conflicts.items())
            raise HandshakeError(f"partition-id {i} is claimed by nodes {sorted(nodes_)}, each with a consistent "
                                 f"claim (dim {self.d}, data): nothing tells the rightful one; bind each partition "
                                 f"to its node's key with node-keys (docs/DEPLOYMENT.md)")
        if missing:
            refused = {i: claims[i] for i in missing if claims.get(i)}
            why = "; ".join(f"partition-id {i}: node {n} {w}" for i, c in refused.items() for n, w in c.items())
            failed = "; ".join(f"node {n}: {r}" for n, r in sorted(self._failed.items())[:3])
            raise HandshakeError(f"no node answered consistently for partition-id(s) {missing}; got {sorted(seen)} "
                                 f"(num-clients = {b})" + (f" — refused: {why}" if why else "")
                                 + (f" — failed: {failed}" if failed else ""))
        self.node_of = {i: seen[i] for i in range(b)}
        self._foreign = set(nodes) - set(self.node_of.values())

    def _ask(self, grid: Grid, nodes: list[int], timeout: float, claims: dict) -> None:
        """Handshake with ``nodes``: each node's claim of a client index goes into ``claims``, as
        consistent (``None``) or with the reason it is refused (counted in ``refused_claims``): an
        error reply, a malformed record, an index outside ``0..b-1``, another ``dim``, no data, or
        (with ``node-keys``) a key that is not the one bound to that partition."""
        if not nodes:
            return
        for msg in grid.send_and_receive([_hello(n) for n in nodes], timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning("node %d failed the handshake (%s): ignored", node, msg.error.reason)
                self._failed[node] = str(msg.error.reason)
                continue
            try:
                rec = config_record(msg.content)
                i, d, n = int(rec["client"]), int(rec["dim"]), int(rec.get("n_data", 1))
            except (KeyError, TypeError, ValueError, OverflowError):
                log.warning("node %d answered the handshake with a malformed record: ignored", node)
                continue
            if not 0 <= i < self.b:
                log.warning("node %d claims partition-id %d, not one of 0..%d: ignored", node, i, self.b - 1)
                continue
            why = None
            if not self._key_matches(grid, i, node):
                why = "its key is not the one bound to that partition (node-keys)"
            else:
                why = handshake.refusal(d, n, self.d, i)
            live = None
            if why is None and "support" in rec:  # read once its d is known to be the run's
                try:
                    live = support_from_bytes(rec["support"], self.d, "support")
                except ValueError as exc:
                    why = f"a malformed support ({exc})"
            claims.setdefault(i, {})[node] = why
            if why is not None:
                self._refuse(i, node, 0, why)
            else:
                self._claimed_n[node] = n
                self._concave[node] = rec.get("log_concave") is True  # anything else: not declared
                self._support[node] = live

    def _settle(self, claims: dict) -> tuple[dict[int, int], dict[int, list[int]]]:
        """``(client → its one consistent node, client → its several consistent nodes)``."""
        seen, conflicts = {}, {}
        for i, c in claims.items():
            ok = sorted(n for n, why in c.items() if why is None)
            if len(ok) == 1:
                seen[i] = ok[0]
                self.n_data[i] = self._claimed_n[ok[0]]  # N_i as claimed (the curvature reports' scale)
                self.log_concave[i] = self._concave.get(ok[0], False)
                self.support[i] = self._support.get(ok[0])
            elif len(ok) > 1:
                conflicts[i] = ok
        return seen, conflicts

    def supports(self, b: int) -> list:
        """Each client's declared support (``None``: every coordinate, or a client not mapped), for the broadcast
        (:func:`qlsd_flwr.protocol.broadcast.set_support`)."""
        return [self.support.get(i) for i in range(b)]

    def rediscover(self, grid: Grid, server_round: int, timeout: float) -> None:
        """Map nodes that joined after the handshake (a SuperNode restarted without node
        authentication registers under a new node id): ask each new node its ``partition-id``
        and send client ``i``'s messages to it from now on. Its state is empty, so it answers
        ``resync`` and gets the anchor and the η_i mirror the round after (see
        :mod:`qlsd_flwr.protocol.wire`). Nodes that do not answer, or are none of our clients,
        are not asked again.

        A newcomer takes client ``i``'s place only if the node that serves ``i`` no longer answers
        (asked once, waiting at most :data:`PROBE_TIMEOUT` seconds): a node that claims the
        ``partition-id`` of a live client is refused and counted (``refused_claims``), so it never
        receives θ, the anchor or a memory mirror, and never has a reply used."""
        # a refused node is asked again every REASK_ROUNDS rounds: the node it was refused for
        # may have died since, and then it is the client's way back
        again = {n for n, r in self._refused_at.items() if server_round - r >= REASK_ROUNDS}
        self._foreign -= again
        for n in again:
            del self._refused_at[n]
        new = set(grid.get_node_ids()) - set(self.node_of.values()) - self._foreign
        if not new:
            return
        self._foreign |= new
        claims: dict[int, int] = {}
        doubled: set[int] = set()
        for msg in grid.send_and_receive([_hello(n) for n in sorted(new)], timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error() or node not in new:
                continue
            try:
                rec = config_record(msg.content)
                i, d = int(rec["client"]), int(rec["dim"])
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
            if 0 <= i < self.b and d == self.d:
                if not self._key_matches(grid, i, node):
                    self._refuse(i, node, server_round, "its key is not the one bound to that partition (node-keys)")
                    continue
                if i in claims or i in doubled:  # two newcomers for one client: neither is trusted
                    self._refuse(i, node, server_round, "another new node claims it too")
                    if i in claims:
                        self._refuse(i, claims.pop(i), server_round, "another new node claims it too")
                    doubled.add(i)
                    continue
                claims[i] = node
        alive = self._answering(grid, [i for i in claims if i in self.node_of], min(timeout, PROBE_TIMEOUT))
        for i, node in sorted(claims.items()):
            if i in alive:
                self._refuse(i, node, server_round, f"node {self.node_of[i]} still serves it")
                continue
            log.info("round %d: client %d rejoined as node %d (was node %d)", server_round, i, node,
                     self.node_of.get(i, -1))
            if i in self.node_of:
                self._foreign.add(self.node_of[i])  # the dead node's id may still look online
            self.node_of[i] = node
            self._foreign.discard(node)
            self.rejoined.setdefault(i, []).append(server_round)

    def _answering(self, grid: Grid, clients: list[int], timeout: float) -> set[int]:
        """The clients among ``clients`` whose mapped node answers a handshake as that client."""
        if not clients:
            return set()
        by_node = {self.node_of[i]: i for i in clients}
        out = set()
        for msg in grid.send_and_receive([_hello(n) for n in by_node], timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error() or node not in by_node:
                continue
            try:
                if int(config_record(msg.content)["client"]) == by_node[node]:
                    out.add(by_node[node])
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
        return out

    def _key_matches(self, grid: Grid, i: int, node: int) -> bool:
        """With ``node-keys``: whether ``node`` registered the public key bound to client ``i``
        (Flower's ``Grid.get_nodes()`` gives each node's registered key); always true without."""
        if not self.bound_keys:
            return True
        want = self.bound_keys.get(i)
        if node not in self._keys_seen:  # one look-up of the SuperLink's nodes for the new ones
            for info in grid.get_nodes():
                self._keys_seen[int(info.node_id)] = normalise_key(bytes(getattr(info, "public_key", b"") or b""))
        return want is not None and self._keys_seen.get(int(node)) == want

    def _refuse(self, i: int, node: int, server_round: int, why: str) -> None:
        self._refused_at[int(node)] = server_round
        log.warning("round %d: node %d claims partition-id %d, refused (%s)", server_round, node, i, why)
        self.refused_claims.setdefault(i, []).append(int(node))

    def memory_reports(self, grid: Grid, timeout: float, clients: list[int], report: str) -> dict:
        """Each of ``clients``' own ``{chain: (η_i, update count)}`` (``report = "memory"``,
        :func:`~qlsd_flwr.protocol.wire.memory_report`) or ``{chain: (digest, update count)}`` (``"memory-digest"``,
        :func:`~qlsd_flwr.protocol.wire.memory_digests`) from its ``context.state`` (chain 0 alone in a one-chain
        run); clients that do not answer, or answer from another node than theirs, are left out."""
        msgs = [_hello(self.node_of[i], report=report) for i in clients]
        got: dict = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                continue
            try:
                rec = config_record(msg.content)
                i = int(rec["client"])
                if self.node_of.get(i) != msg.metadata.src_node_id:
                    continue
                got[i] = memory_report(rec, self.d) if report == "memory" else memory_digests(rec)
            except (KeyError, TypeError, ValueError):
                continue
        return got

    def finish_run(self, server, grid: Grid, timeout: float) -> None:
        """After the last round: the memory audit (every client's own ``η_i`` against the server's
        mirror, when the sampler has memory), then ``server.finish()`` with the nodes' facts
        (rejoins, refused claims) in the summary. A stop during the audit, which waits for the
        nodes up to ``timeout``, still closes the outputs."""
        extra: dict = {"rejoined": {str(i): r for i, r in sorted(self.rejoined.items())},
                       "refused_claims": {str(i): r for i, r in sorted(self.refused_claims.items())}}
        try:
            if server.cfg.memory:
                wait = max(timeout, AUDIT_WAIT)
                # digests first, the vectors only where one differs from its mirror (protocol.memory_audit)
                digests = self.memory_reports(grid, wait, list(range(self.b)), "memory-digest")
                mirrors = [ch.state.eta_i for ch in getattr(server, "chains", [server])]
                bad = memory_audit.differing(mirrors, digests)
                full = self.memory_reports(grid, wait, sorted(bad), "memory") if bad else {}
                reports = memory_audit.reports_from(mirrors, digests, bad, full)
                if bad:
                    extra["memory_digest_differs"] = {str(i): cs for i, cs in sorted(bad.items())}
                    unsent = {str(i): [c for c in cs if c not in full.get(i, {})] for i, cs in sorted(bad.items())}
                    log.warning("memory check: η_i differs from the server's mirror (digest) for clients %s; not sent "
                                "again by %s (summary.json 'memory_digest_differs')", extra["memory_digest_differs"],
                                {i: cs for i, cs in unsent.items() if cs} or "none")
                # what the audit moved: a digest and a count a chain up, the vectors asked again (no array goes down)
                extra["memory_check_bits"] = {"uplink": 128 * sum(len(r) for r in digests.values())
                                              + 64 * self.d * sum(len(r) for r in full.values()), "downlink": 0}
                if server.cfg.num_chains == 1:
                    reports = {i: r[0] for i, r in reports.items() if 0 in r}
                extra["memory_check"] = server.memory_check(reports)
        except BaseException as exc:
            server.ts_info = {**server.ts_info, **extra}
            server.stop(exc)
            raise
        server.ts_info = {**server.ts_info, **extra}  # finish() puts ts_info in the summary
        server.finish()
