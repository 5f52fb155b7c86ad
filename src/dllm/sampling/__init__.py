"""Sampling: policies decide what to write at each step; generate.py owns the one loop, runner.py the
model call and its cache; canvas.py lays out the rows; proposals.py turns logits into proposals."""
