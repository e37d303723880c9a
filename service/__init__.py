"""tensorgate: a production inference server for PyTorch-trained models."""

__version__ = "0.1.0"
