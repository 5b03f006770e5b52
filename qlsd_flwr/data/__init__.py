"""Offline and hub datasets and partitioners."""
