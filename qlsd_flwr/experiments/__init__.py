"""Experiment drivers that compare QLSD with baselines (FedAvg, the main job).
Nothing in the library imports them."""
