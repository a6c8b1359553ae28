"""The cost model: what a DiffusionGemma run costs, from its config alone (no weights read, no torch).

    counts.py  parameters, bytes by dtype, FLOPs and bytes per step / commit / prefill, roofline floor
    vocab.py   the vocabulary pass's peak memory (CPU and CUDA), restating the kernels' constants
    memory.py  a batched run's memory: the paged KV cache, per slot, fixed, the largest batch that fits
    gguf.py    a GGUF file's inventory from its header and whether a run fits
    card.py    `card()`: the one dict `dgemma info` prints and `dgemma bench` puts first

Imports run one way (counts -> vocab -> memory -> gguf, card). Callers use this package's names
(`from dgcli.measure import cost`); the device peaks are dgcli.measure.peaks', re-exported here.
"""

# ruff: noqa: F401  (re-exports: the cost model's public names in one place)
from dgcli.measure.cost.card import card
from dgcli.measure.cost.counts import (DTYPE_BYTES, Cost, block_cost, bytes_by_dtype_for, distinct_experts,
                                       encode_cost, floor_seconds, param_counts, quantized_counts,
                                       safetensors_inventory, step_cost, weights_bytes_total)
from dgcli.measure.cost.gguf import gguf_inventory, gguf_section
from dgcli.measure.cost.memory import (GIB, GPUS, KV_BLOCK, cache_blocks, cache_bytes, kv_bytes, markdown, one_request,
                                       peak_bytes)
from dgcli.measure.peaks import DEVICE_TABLE, Peaks, gpu_peaks, measure_cpu_peaks
