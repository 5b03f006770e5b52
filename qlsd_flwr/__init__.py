"""qlsd_flwr: the QLSD family of federated Langevin samplers (Vono et al., AISTATS 2022) on Flower."""

__version__ = "0.1.0"
