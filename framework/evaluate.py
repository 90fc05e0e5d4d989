"""`python -m framework.evaluate`: the door lives in framework/doors/evaluate.py (framework/doors/ holds
every front door); this path stays for the command users type."""

import sys

from framework.doors.evaluate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
