"""Deployment tooling: helpers for running qlsd-flwr on a real Flower deployment (``flower-superlink`` +
``flower-supernode`` + ``flwr run``), used by ``tests/test_deployment.py``,
``benchmarks/bench_deployment.py`` and described in ``docs/DEPLOYMENT.md``.

* certificates and keys: :func:`make_tls_certificates` (a CA and a server certificate signed
  by it, with the server's addresses as SANs) and :func:`make_node_keypair` (an EC P-384
  key pair in OpenSSH format, the format ``flower-supernode --auth-supernode-private-key``
  and ``flwr supernode register`` read);
* processes: :class:`Proc` (start a process in its own session, log to a file, stop it by
  its PID: SIGTERM to its process group, then SIGKILL), :func:`free_port`, :func:`wait_port`;
* the Flower CLI: :func:`write_connection` (a SuperLink connection in ``$FLWR_HOME/config.toml``),
  :func:`stage_app` (a copy of the app without the simulation federations of
  ``pyproject.toml``, which ``flwr run`` would otherwise migrate and comment out),
  :func:`flwr_run`, :func:`run_status`, :func:`wait_run`.

Nothing here fetches anything: runtime dependency installation is off everywhere.
"""

# one namespace for the package's helpers (``from qlsd_flwr import deploy as D``)
from qlsd_flwr.deploy.certs import *  # noqa: E402, F403
from qlsd_flwr.deploy.cluster import LocalDeployment  # noqa: E402, F401
from qlsd_flwr.deploy.flwr_cli import *  # noqa: E402, F403
from qlsd_flwr.deploy.processes import *  # noqa: E402, F403
