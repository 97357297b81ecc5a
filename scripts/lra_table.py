"""The LRA-style table of a long-sequence sweep (the same as the `mhalab-lra-table` command).

    python scripts/lra_table.py multirun/lra                                  # -> multirun/lra/lra_table.md
    python scripts/lra_table.py multirun/lra out=results/lra/README.md notes_file=notes.md retime=true
"""

import sys

from mhalab.analysis.lra import main

if __name__ == "__main__":
    sys.exit(main())
