"""Families: how each Hugging Face checkpoint layout maps onto the one native Transformer.

base.py holds the Family record (config.json keys <-> ModelConfig fields, a weight-name map and its
tensor transforms) and the functions that apply a map in both directions; each other module holds the
families of one group of checkpoint layouts: llama.py (LLaMA's weight names, dense and MoE), llada.py,
gpt2.py, encoders.py (BERT, ModernBERT), diffusion_gemma.py. dllm.config.registries.FAMILIES names each family as
"families.<module>:<OBJECT>"; this package imports nothing, so resolving one family loads one module.
"""
