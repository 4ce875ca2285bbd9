"""Workflows built on the hf_dp core: corpora, tasks, the study behind `hf-dp demo`, and the Gradio app.

The core (`hf_dp.arguments`, `hf_dp.trainer`, `hf_dp.data` → `sampling` → `batching` → `clipping` → `noise`,
`hf_dp.accounting`, `hf_dp.card`, `hf_dp.hub`, `hf_dp.formatting`) imports nothing from here, nor from
`hf_dp.audit` or the UI (`tests/test_imports.py` checks it); this package is one user of it. Its third-party needs
are extras: `pip install 'hf_dp[demo]'` (`hf-dp demo`, `hf-dp audit`), `pip install 'hf_dp[app]'` (`hf-dp app`).
"""
