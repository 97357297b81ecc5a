"""mhalab: Multi-Head Attention from scratch, and a framework to train and sweep encoders built on it."""

__version__ = "0.1.0"
