"""Launcher for the hf_dp Gradio app: `python app/app.py --results_dir results` (same as `hf-dp app`).

The implementation lives in the package ([`hf_dp.workflows.app`]) so that the installed `hf-dp app` works without this
folder; see its docstring for what the four tabs show and which module does what.
"""

import sys

from hf_dp.workflows.app import build_app, main  # noqa: F401  (build_app: for `gradio app/app.py`-style reuse)

if __name__ == "__main__":
    sys.exit(main())
