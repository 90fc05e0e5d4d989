"""`python -m framework.export`: the door lives in framework/doors/export.py (framework/doors/ holds
every front door); this path stays for the command users type."""

import sys

from framework.doors.export import main

if __name__ == "__main__":
    sys.exit(main())
