"""The ClientApp: this node's potential; qlsd-flwr handles the protocol and the state."""

from qlsd_flwr.flower import make_client_app
from qlsd_quickstart.task import potential

app = make_client_app(lambda context: potential(int(context.node_config["partition-id"]),
                                                int(context.node_config["num-partitions"])))
