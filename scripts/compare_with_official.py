"""Ours vs PyTorch's attention and encoder layers, weights copied: `mhalab-compare` from a checkout.

    python scripts/compare_with_official.py        (or: make compare; exits 1 if a diff exceeds 1e-5)
What is compared: src/mhalab/checks/compare.py (`python scripts/compare_with_official.py --help`).
"""

import sys

from mhalab.checks.compare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python scripts/compare_with_official.py"))
