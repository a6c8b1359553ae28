"""`python -m dgcli.train ...`: train the bundled tiny model (see dgcli/train/trainer.py). Must not: hold logic."""

from dgcli.train.trainer import main

raise SystemExit(main())
