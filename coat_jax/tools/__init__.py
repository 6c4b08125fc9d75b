"""Command-line tools: ``python -m coat_jax.tools.<name>``."""
