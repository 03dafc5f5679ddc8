"""`python -m tenax ...` is the `tenax` command."""
import sys

from tenax.orchestrator.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
