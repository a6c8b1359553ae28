"""Rendering of runs: `watch` frames (terminal, SVG, the HTML replay from `data/replay.html`) and the JSONL
trace writer/reader. Everything here consumes event records.

Must not: run the model, tokenize, or decide sampler settings.
"""
