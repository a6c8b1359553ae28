"""Checkpoints, the one layer that knows file formats: which format a path holds and opening it (load.py), a
safetensors directory, plain, FP8 or NVFP4 (directory.py, config.py, compressed_tensors.py, nvfp4.py), a GGUF file
(gguf.py: the byte format, on gguf-py's writer and type table; gguf_model.py: DiffusionGemma in it; mapped.py: its
kernels' forms), random weights (random_weights.py), and `dgemma quantize`'s writers (quantize.py; ggml_quants.py:
the GGML block encoders).

Owns: every file a model is read from or written to. Must not: compute (model/ does), sample, print, or import
from runtime/, cli/, measure/, sampling/, render/ or train/. Imports nothing here (the config side stays torch-free).
"""
