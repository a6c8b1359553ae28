"""Measurement: the bench workload and timed runs, the one row record and its figures, the cost model (cost/:
counts, memory, the card, GGUF inventories; peaks.py: device peaks), the printers (md, csv, json, jsonl) and
sweeps (grid, resumable store, Pareto frontier).

Must not: contain a denoising loop (it consumes `engine.generate_events` through runtime/), or
parse command lines.
"""
