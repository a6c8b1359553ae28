"""The sampling layer: the entropy-bound sampler's rules as pure functions (`rules.py`), its counter-addressed
random stream (`draws.py`), its typed events (`events.py`), `DiffusionEbParams` with its one validator
(`params.py`), structured output (`constrain.py`: the automaton, `joint.py`: the draw) and the one way the host reads
the device (`host_reads.py`).
Must not: import the engine or the model, tokenize, read files, print, or know about presets or commands.
"""
