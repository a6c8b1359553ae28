"""The model layer: checkpoint config, loader (+ the checkpoint's quirks), the DiffusionGemma network, its KV
cache, and random weights in the released layout (for --dummy, tests and benchmarks).

Owns: everything between a checkpoint directory and hidden states / logits. Must not: tokenize, sample,
print, or import from sampling/, runtime/, cli/, measure/, render/ or train/.
"""
