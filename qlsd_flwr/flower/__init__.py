"""Flower's side: the Message-API strategy and apps, the legacy pair, node management,
message sizing. These classes only translate between Flower messages and the protocol.

The public API for your own model::

    from qlsd_flwr.flower import QLSDStrategy, make_client_app
    # FedAvg on the same clients and model (Flower's own strategy; MAP training):
    from qlsd_flwr.flower import fedavg_strategy, make_fedavg_client_app, plug_in_probs
    # a Flower Grid in this process (scripts and tests, no Ray):
    from qlsd_flwr.flower import InProcessGrid
"""

from qlsd_flwr.flower.client_app import make_client_app
from qlsd_flwr.flower.fedavg import fedavg_strategy, make_fedavg_client_app, plug_in_probs
from qlsd_flwr.flower.inprocess import InProcessGrid
from qlsd_flwr.flower.logs import one_line_errors
from qlsd_flwr.flower.strategy import QLSDStrategy

__all__ = ["QLSDStrategy", "make_client_app", "fedavg_strategy", "make_fedavg_client_app", "plug_in_probs",
           "InProcessGrid"]

one_line_errors()  # a user's ServerApp imports this package: its errors reach flwr log as one line too
