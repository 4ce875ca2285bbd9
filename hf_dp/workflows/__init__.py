"""Workflows built on the hf_dp core: corpora, tasks, the study behind `hf-dp demo`, and the Gradio app.

The core (`hf_dp.arguments`, `hf_dp.trainer`, `hf_dp.data` → `sampling` → `batching` → `clipping` → `noise`,
`hf_dp.accounting`, `hf_dp.card`, `hf_dp.hub`) imports nothing from here; this package is one user of it.
"""
