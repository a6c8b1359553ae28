"""The sampling layer: the entropy-bound sampler's rules as pure functions (`rules.py`: the schedule, one step on
the canvas rows), its counter-addressed random stream (`draws.py`), its typed events (`events.py`),
`DiffusionEbParams` with its one validator (`params.py`) and the one way the host reads the device (`host_reads.py`).
The loop that runs them over a model is the engine's (`dgcli.engine`).

Must not: import the engine or the model, tokenize, read files, print, or know about presets, commands or
checkpoints' generation_config.json (runtime/ resolves those).
"""
