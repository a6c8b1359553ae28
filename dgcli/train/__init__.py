"""Training of the bundled tiny model: `python -m dgcli.train` (trainer.py) and its task data (tasks.py).

Never imported by the rest of dgcli at run time (tests/test_layout.py walks the imports to check).
"""
