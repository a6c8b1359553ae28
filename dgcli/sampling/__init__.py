"""The sampling layer: the one entropy-bound denoising loop (`loop.generate_events`), its typed events, and
`DiffusionEbParams` with its one validator.

Owns: turning a model + prompt ids into events and a `Done`. Must not: tokenize, read files, print, or know
about presets, commands or checkpoints' generation_config.json (runtime/ resolves those).
"""
