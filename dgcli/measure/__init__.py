"""Measurement: the bench workload and timed runs, the one row record and its figures, the cost model (cost/),
device peaks, the printers (md, csv, json, jsonl) and sweeps. Must not: contain a denoising loop (it consumes the
engine's events through runtime/), or parse command lines.
"""
