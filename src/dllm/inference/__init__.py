"""The inference engine: a scheduler, one executor, and `generate` (offline and served decoding are one path)."""
