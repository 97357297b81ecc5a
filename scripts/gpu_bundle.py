"""Build .gpu/ (here, with PyPI): the wheels the bare GPU machine lacks, an SST-2 copy, MANIFEST.json.

    python scripts/gpu_bundle.py                    # make gpu-bundle
    python scripts/gpu_bundle.py --train-rows 20000
What is in it and why: src/mhalab/checks/gpu_check.py.
"""

import sys

from mhalab.checks.gpu_check import bundle_main

if __name__ == "__main__":
    sys.exit(bundle_main(sys.argv[1:]))
