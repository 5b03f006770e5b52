"""Metrics, HPD errors, reference samplers, predictive evaluation, the readable report."""
