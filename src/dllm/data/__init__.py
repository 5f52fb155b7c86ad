"""Data: preparation (corpus -> artifact), the artifact format, and the training loader."""
