"""The sampling layer: the one entropy-bound denoising loop (`engine.Engine`, entered through
`loop.generate_batch_events` / `loop.generate_events`), its rules and random stream, its typed events, and
`DiffusionEbParams` with its one validator.

Owns: turning a model + prompt ids into events and a `Done`. Must not: tokenize, read files, print, or know
about presets, commands or checkpoints' generation_config.json (runtime/ resolves those).
"""
