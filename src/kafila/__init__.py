"""Kafila: serve one large language model across a small, trusted ring of heterogeneous machines."""

__version__ = "0.1.0"
