"""Evaluation: likelihood bounds, exact-answer tasks, the lm-evaluation-harness adapter."""
