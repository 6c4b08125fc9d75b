"""Checkpoints with orbax: params, the FP8 optimizer state, and the run's position.

A checkpoint holds three items: ``params`` and ``opt_state`` (FP8 codes, fp32 scales and uint8
exponents restore bit-exactly; orbax saves float8 dtypes natively) and ``meta`` (JSON: step,
data position, seed). Orbax writes each step into a temporary folder and renames it when
complete, so a process killed mid-save leaves the previous checkpoints loadable; the newest
``keep`` are kept. Saves are asynchronous: training continues while the bytes are written.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


def _abstract(tree):
    """Restore target: shapes, dtypes and shardings of ``tree`` (arrays or abstract)."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """Saves and restores training state under ``<directory>/<step>``.

    Args:
      directory: checkpoint folder (created if missing).
      keep: how many of the newest checkpoints to keep.
      async_save: write in the background (``wait()`` blocks until done).
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("params", "opt_state", "meta"), options=options
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(dict(meta, step=step)),
            ),
        )

    def restore(self, step: int, params_like, opt_state_like):
        """``(params, opt_state, meta)`` of ``step``, laid out like the given (abstract) trees."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like)),
                opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored.params, restored.opt_state, restored.meta

    def restore_params(self, step: int, params_like):
        """Only the params of ``step`` (to fine-tune from a run, or to export it)."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params_like)))
        return self._manager.restore(step, args=args).params

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
