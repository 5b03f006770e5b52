"""Flower's side: the Message-API strategy and apps, the legacy pair, node management,
message sizing. These classes only translate between Flower messages and the protocol."""
