"""Attention functions registered with transformers and their torch references."""
