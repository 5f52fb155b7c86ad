"""Training: assembly from a RunSpec (build.py) and the loop (trainer.py)."""
