"""QLSD++ on a small Bayesian neural network for scikit-learn's wine data."""
