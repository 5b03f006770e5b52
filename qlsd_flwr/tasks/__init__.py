"""Potentials, models and data. Each task builds a :class:`~qlsd_flwr.tasks.base.Task`."""
