"""dllm: train, sample and evaluate diffusion language models.

Importing this package is cheap: it imports neither torch-heavy submodules nor transformers.
"""

__version__ = "0.1.0"
