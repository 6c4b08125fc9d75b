"""The environment of a child Python process the tests start (train.py, a bench, a snippet)."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child_env(*, drop_prefix: str | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` with the checkout first on ``PYTHONPATH``, variables starting with
    ``drop_prefix`` removed, then ``extra``. The parent's ``PYTHONPATH`` entries are kept, made
    absolute (a machine that runs the checkout uninstalled has its dependencies there)."""
    env = {k: v for k, v in os.environ.items() if not (drop_prefix and k.startswith(drop_prefix))}
    parent = filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    path = [str(ROOT), *map(os.path.abspath, parent)]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **extra}
