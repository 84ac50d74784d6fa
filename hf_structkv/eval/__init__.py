"""Evaluation data read offline from PyPI data packages, and their metrics."""
