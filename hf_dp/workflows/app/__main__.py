"""`python -m hf_dp.workflows.app --results_dir results`: the same as `hf-dp app`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
