"""Potentials, models and data. Each task builds a :class:`~qlsd_flwr.core.potential.Task`."""
