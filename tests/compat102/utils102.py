"""Helpers shared by the 1.0.2-style scripts (data, a tiny CNN, the log path).

Like the ``_utils_examples.py`` that ships next to cockpit-for-pytorch 1.0.2's
examples, but without downloads: scikit-learn's bundled ``load_digits`` (8x8 images,
10 classes) stands in for Fashion-MNIST.
"""

import argparse
import os

import torch
from sklearn.datasets import load_digits


def digits_data(batch_size=16, shuffle=True):
    """Return a DataLoader over the digits data (images scaled to [0, 1])."""
    torch.manual_seed(0)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    dataset = torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True
    )


def mlp():
    """A small fully-connected net for 1x8x8 inputs."""
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(64, 12),
        torch.nn.ReLU(),
        torch.nn.Linear(12, 10),
    )


def cnn():
    """A tiny convolutional net for 1x8x8 inputs (conv, pool, two dense layers)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2, 2),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 3 * 3, 12),
        torch.nn.ReLU(),
        torch.nn.Linear(12, 10),
    )


def get_logpath(outdir, suffix=""):
    """Create ``<outdir>/logfiles`` and return the log path inside it (no suffix)."""
    save_dir = os.path.join(outdir, "logfiles")
    os.makedirs(save_dir, exist_ok=True)
    return os.path.join(save_dir, f"cockpit_output{suffix}")


def parse_args(default_steps):
    """``--steps K --outdir DIR`` for every script."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--outdir", default="compat102_out")
    return parser.parse_args()
