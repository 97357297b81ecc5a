"""Speed and memory of our attention / encoder vs PyTorch's: `mhalab-bench` from a checkout (make bench).

    python scripts/bench.py quick=true targets=true    # ~2-3 min on a 2-core CPU, with the issue's checks
    python scripts/bench.py device=cuda                # bf16 autocast, L = 128..8192, TFLOP/s and MFU
What is measured, and every option: src/mhalab/checks/bench/ (`python scripts/bench.py --help`).
"""

import sys

from mhalab.checks.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python scripts/bench.py"))
