"""Flower's side: the Message-API strategy and apps, the legacy pair, node management,
message sizing. These classes only translate between Flower messages and the protocol.

The public API for your own model::

    from qlsd_flwr.flower import QLSDStrategy, make_client_app
"""

from qlsd_flwr.flower.client_app import make_client_app
from qlsd_flwr.flower.strategy import QLSDStrategy

__all__ = ["QLSDStrategy", "make_client_app"]
