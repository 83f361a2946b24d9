"""`python -m kvpage ...` is the `kvpage` command (works before a console-script shim exists)."""
import sys

from kvpage.cli import main

if __name__ == "__main__":
    sys.exit(main())
