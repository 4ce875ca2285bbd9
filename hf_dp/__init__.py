"""hf_dp: user-level differentially private fine-tuning for the Hugging Face stack."""

__version__ = "0.1.0"

__all__ = ["__version__"]
