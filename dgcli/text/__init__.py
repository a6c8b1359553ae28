"""The text layer: the checkpoint tokenizer and chat template, prompt files, and the builder of
Gemma-4-layout tokenizers (random checkpoints and training use it).

Must not: import torch or know about the model or the sampler.
"""
