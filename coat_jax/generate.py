"""``python -m coat_jax.generate``: sample text from a coat-jax run or a Hugging Face folder.

The command of :mod:`coat_jax.tools.generate` (``--help`` lists its options) under the name
users type; the library function is :func:`coat_jax.training.generate.generate`.
"""

import sys

from coat_jax.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
