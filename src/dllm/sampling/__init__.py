"""Sampling: policies decide what to commit; generate.py owns the loop and the model calls."""
