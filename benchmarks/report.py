"""The results table for this machine: the quick form of every benchmark that needs no root and no
other checkout, collected into a markdown table and a PNG (pslink.bench.report says how).

    python benchmarks/report.py --out bench-report        # or: pslink bench report --out bench-report
    python benchmarks/report.py --pslite ~/src/ps-lite    # with C++ ps-lite side by side
    python benchmarks/report.py --from LOG... --out DIR   # the table from saved benchmark outputs
"""

import sys

from pslink.bench.report import main

if __name__ == "__main__":
    sys.exit(main())
