"""Handwritten digits: the smallest real DDP job (model and dataset factories).

``build_dataset`` uses scikit-learn's bundled 8x8 digits (1,797 images; no download) with a fixed
stratified 80/20 split, so every rank and every run sees the same training and validation sets.
``build_model`` is a two-hidden-layer MLP. With ``job.yaml`` (2 CPU ranks, AdamW 3e-3, batch 32
per rank, 8 epochs) it reaches >= 0.95 validation accuracy in a few seconds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

IMAGE_PIXELS = 64
CLASSES = 10


def build_model(hidden: int = 128, dropout: float = 0.1) -> nn.Module:
    """An MLP from the 64 pixels to the 10 classes."""
    return nn.Sequential(
        nn.Linear(IMAGE_PIXELS, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, CLASSES),
    )


def build_dataset(
    val_fraction: float = 0.2, split_seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) as tensors: pixels scaled to [0, 1], labels as class indices."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, val_x, train_y, val_y = train_test_split(
        images, labels, test_size=val_fraction, random_state=split_seed, stratify=labels
    )

    def tensors(x: object, y: object) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(x, dtype=torch.float32) / 16.0, torch.as_tensor(y, dtype=torch.long)
        )

    return tensors(train_x, train_y), tensors(val_x, val_y)
