"""Models and data for the examples, the demo and the benchmarks.

ResNet-32 on CIFAR-10-shaped data is the paper's workload. Data is synthetic
by default (deterministic, no download); ``load_cifar10(path)`` reads the real
python-pickle-free ``.npz`` form of CIFAR-10 if a user has one locally.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf


def resnet32(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3)) -> tf.keras.Model:
    """He et al.'s CIFAR ResNet with n=5 (6n+2 = 32 layers), about 0.46 M parameters."""
    inputs = tf.keras.Input(shape=input_shape)
    x = tf.keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = tf.keras.layers.BatchNormalization()(x)
    x = tf.keras.layers.ReLU()(x)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(5):
            stride = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = tf.keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
            y = tf.keras.layers.BatchNormalization()(y)
            y = tf.keras.layers.ReLU()(y)
            y = tf.keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
            y = tf.keras.layers.BatchNormalization()(y)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = tf.keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
                shortcut = tf.keras.layers.BatchNormalization()(shortcut)
            x = tf.keras.layers.ReLU()(tf.keras.layers.Add()([y, shortcut]))
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(num_classes)(x)
    return tf.keras.Model(inputs, outputs, name="resnet32")


def small_cnn(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3)) -> tf.keras.Model:
    """A fast stand-in with the same input and output shapes (for tests)."""
    return tf.keras.Sequential([
        tf.keras.Input(shape=input_shape),
        tf.keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(num_classes),
    ], name="small_cnn")


MODELS = {"resnet32": resnet32, "small_cnn": small_cnn}


def synthetic_cifar10(n: int = 2048, seed: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Learnable CIFAR-10-shaped data: each class is a fixed random image plus noise."""
    rng = np.random.default_rng(seed)
    prototypes = rng.standard_normal((10, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 10, n)
    images = prototypes[labels] + 0.5 * rng.standard_normal((n, 32, 32, 3)).astype(np.float32)
    return images, labels.astype(np.int64)


def load_cifar10(path: str | Path) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Real CIFAR-10 from an ``.npz`` with ``x_train`` (N,32,32,3 uint8) and ``y_train``."""
    with np.load(path, allow_pickle=False) as data:
        x = data["x_train"].astype(np.float32) / 255.0
        y = data["y_train"].reshape(-1).astype(np.int64)
    return (x - x.mean(axis=(0, 1, 2))) / x.std(axis=(0, 1, 2)), y


def batches(images: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], batch_size: int, seed: int) -> tf.data.Dataset:
    """An endless, shuffled stream of batches; ``seed`` differs per worker.

    Built from tensors (no Python generator thread feeds it).
    """
    data = tf.data.Dataset.from_tensor_slices((images, labels))
    # No autotuning: its model thread can hold up the iterator's destruction for tens of
    # seconds on a busy CPU, and an elastic reset destroys the iterator while the VM's
    # notice window is running.
    options = tf.data.Options()
    options.autotune.enabled = False
    return (data.shuffle(len(images), seed=seed, reshuffle_each_iteration=True).repeat()
            .batch(batch_size, drop_remainder=True).prefetch(2).with_options(options))
