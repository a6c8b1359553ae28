import os
import sys
from pathlib import Path

# tests/ helpers (hf_oracle, fixtures) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tests use tiny shapes on 2 shared cores: a second intra-op thread only adds barrier waits
# (oversubscribed, tiny ops run up to 50x slower). Subprocesses the tests start keep torch's default.
torch.set_num_threads(1)
