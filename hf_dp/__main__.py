"""`python -m hf_dp ...`: the same as the `hf-dp` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
