"""Offline and hub datasets (:mod:`.datasets`) and partitioners (:mod:`.partition`).

A user's own dataset (``dataset = "my_pkg.my_data:load"``) returns an :class:`ArrayDataset`.
"""

from qlsd_flwr.data.datasets import ArrayDataset, DatasetUnavailableError, load_dataset

__all__ = ["ArrayDataset", "DatasetUnavailableError", "load_dataset"]
