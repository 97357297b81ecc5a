"""The one-command GPU check (run on the lent GPU machine): CUDA tests, encoder benchmark, a bf16 training run.

    python3 scripts/gpu_check.py          # there, after `make gpu-bundle` here and carry [".gpu"]
    python3 scripts/gpu_check.py --cpu    # the dry run, here
How to use it, what it runs and what comes back: src/mhalab/checks/gpu_check.py (`--help`).
"""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:  # the bare GPU machine has mhalab's source, not an install of it
    sys.path.insert(0, str(SRC))

from mhalab.checks.gpu_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
