"""Speed and memory of our attention / encoder vs PyTorch's (see mhalab/bench.py for what is measured).

    python scripts/bench.py --quick --targets        # ~2-3 min on a 2-core CPU, with the issue's checks
    python scripts/bench.py                          # full sweep, L = 64..2048 on CPU
    python scripts/bench.py --device cuda            # bf16 autocast, L = 128..8192, TFLOP/s and MFU
Writes bench.json, bench.md and bench.png to results/bench/<device-name>/ (or --out).
"""

import sys

from mhalab.analysis.bench import main

if __name__ == "__main__":
    sys.exit(main())
