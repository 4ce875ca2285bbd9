"""The Results tab's privacy card: the selected run's README.md (the card [`hf_dp.card`] wrote), rendered."""

from __future__ import annotations

from .common import AppError, error_md
from .results import find_run


def privacy_card_markdown(results_dir, run_name: str | None) -> str:
    """The selected run's privacy card (its README.md without the YAML front matter), or a one-line reason."""
    try:
        run = find_run(results_dir, run_name)
        path = run.model_path
        if path is None:
            return (f"**{run.name}** is the public-only baseline: the pretrained model used without any private "
                    "data, so it has no privacy card.")
        readme = path / "README.md"
        if not readme.is_file():
            raise AppError(f"{readme} does not exist: this run has no privacy card.")
        from huggingface_hub import ModelCard

        return ModelCard.load(readme).text
    except Exception as error:
        return error_md(error)
