"""Diffusion processes: noise schedules, corruption, and training objectives."""
