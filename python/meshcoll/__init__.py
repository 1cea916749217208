"""meshcoll: collective communication for Python training loops."""

__version__ = "0.1.0"
