"""advisor: auto-tuning advisor for distributed LLM training with thermal-aware placement."""
__version__ = "0.1.0"
