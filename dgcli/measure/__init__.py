"""Measurement: the bench workload and timed runs, the one row record and its figures, the roofline card,
the printers (md, csv, json, jsonl) and sweeps (grid, resumable store, Pareto frontier).

Must not: contain a denoising loop (it consumes `engine.generate_events` through runtime/), or
parse command lines.
"""
