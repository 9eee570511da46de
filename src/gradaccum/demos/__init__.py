"""The seed experiment's pieces: the MNIST reader and the demo models."""

from gradaccum.demos.mnist import MNIST_MEAN, MNIST_STD, load_mnist, mnist_tensors
from gradaccum.demos.models import MODELS, build_model

__all__ = ["MNIST_MEAN", "MNIST_STD", "MODELS", "build_model", "load_mnist", "mnist_tensors"]
