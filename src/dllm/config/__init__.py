"""Typed configs: RunSpec (training), PrepareSpec (data preparation), loading and rules.

This package is the only place where a string from a file picks an implementation.
"""

from dllm.config.loading import dump_config, load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec

__all__ = ["PrepareSpec", "RunSpec", "dump_config", "load_config"]
