"""`python -m framework.report`: the door lives in framework/doors/report.py (framework/doors/ holds
every front door); this path stays for the command users type."""

import sys

from framework.doors.report import main

if __name__ == "__main__":
    sys.exit(main())
