"""The engine: nano-vllm's parts for the block-diffusion sampler, and the one loop every front-end drives.

`LLMEngine` (llm_engine.py: add_request / submit, cancel, step -> events), its parts `request.py`,
`scheduler.py`, `block_manager.py` (host) + `kv_cache.py` (device), `runner.py`, the one output processor
`output.py` and the loop's entry points (loop.py). Front-ends (runtime/, serve/, cluster/) import only what
this file names.
Must not: import the model (the model imports `kv_cache.py`, the cache it reads and writes), tokenize or print.
"""

import importlib

# name -> the module that owns it; loaded at first use, so `dgcli.engine.request`'s checks (the server's parser)
# load without torch
_OWNER = {
    "generate": "loop", "generate_batch_events": "loop", "generate_events": "loop",
    "DEFAULT_BUDGET": "llm_engine", "KeptEngine": "llm_engine", "LLMEngine": "llm_engine", "new_engine": "llm_engine",
    "Output": "output", "cut": "output",
    "PROMPT_FIX": "request", "Request": "request", "check_ids": "request", "kind": "request",
    "out_of_vocab": "request", "over_context": "request",
}
__all__ = sorted(_OWNER)


def __getattr__(name: str):
    if name not in _OWNER:
        raise AttributeError(f"module 'dgcli.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dgcli.engine.{_OWNER[name]}"), name)
    globals()[name] = value
    return value
