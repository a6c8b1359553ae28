import os
import sys
from pathlib import Path

# tests/ helpers (hf_oracle, fixtures) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
