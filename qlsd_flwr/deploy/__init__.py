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

from qlsd_flwr.deploy.certs import make_node_keypair, make_tls_certificates
from qlsd_flwr.deploy.cluster import LocalDeployment
from qlsd_flwr.deploy.flwr_cli import (
                                       REPO,
                                       app_config,
                                       count_in_log,
                                       flwr_cli,
                                       flwr_run,
                                       format_run_config,
                                       register_node,
                                       register_nodes,
                                       run_log,
                                       run_status,
                                       stage_app,
                                       wait_run,
                                       write_connection,
                                       write_partition,
)
from qlsd_flwr.deploy.processes import (
                                       BIN,
                                       RAY_JOBS_SCRIPT,
                                       Proc,
                                       flwr_env,
                                       free_port,
                                       node_config_arg,
                                       ray_cluster_state,
                                       ray_head_argv,
                                       stop_all,
                                       superlink_argv,
                                       supernode_argv,
                                       wait_port,
)

__all__ = ["make_node_keypair", "make_tls_certificates", "LocalDeployment", "REPO", "app_config",
           "count_in_log", "flwr_cli", "flwr_run", "format_run_config", "register_node", "register_nodes",
           "run_log", "run_status", "stage_app", "wait_run", "write_connection", "write_partition", "BIN",
           "RAY_JOBS_SCRIPT", "Proc", "flwr_env", "free_port", "node_config_arg", "ray_cluster_state",
           "ray_head_argv", "stop_all", "superlink_argv", "supernode_argv", "wait_port"]
