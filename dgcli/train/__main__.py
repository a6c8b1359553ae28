"""`python -m dgcli.train ...`: train the bundled tiny model (see dgcli/train/trainer.py)."""

from dgcli.train.trainer import main

raise SystemExit(main())
