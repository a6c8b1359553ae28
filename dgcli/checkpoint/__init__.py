"""Checkpoints, the one layer that knows file formats: which format a path holds and opening it
(load.py: `format_of`, `load_config`, `load_generation_config`, `load_tokenizer`, `load_model`), a safetensors
directory, plain or compressed-tensors FP8 (directory.py, config.py, compressed_tensors.py), a GGUF file (gguf.py:
the byte format; gguf_model.py: DiffusionGemma in it), random weights for --dummy, tests and benchmarks
(random_weights.py), and `dgemma quantize`'s writers (quantize.py; ggml_quants.py: the GGML block encoders).

Owns: every file a model is read from or written to. Must not: compute (model/ does), sample, print, or import
from runtime/, cli/, measure/, sampling/, render/ or train/. Imports nothing here (the config side stays torch-free).
"""
