"""Checkpoints with orbax: params, the FP8 optimizer state, and the run's position.

A checkpoint holds three items: ``params`` and ``opt_state`` (FP8 codes, fp32 scales and uint8
exponents restore bit-exactly; orbax saves float8 dtypes natively) and ``meta`` (JSON: step,
data position, seed, the run's config). Orbax writes each step into a temporary folder and
renames it when complete, so a process killed mid-save leaves the previous checkpoints
loadable; the newest ``keep`` are kept. Saves are asynchronous: training continues while the
bytes are written.

What is never kept or loaded: a state with a non-finite value (:meth:`Checkpointer.save`
refuses it, :meth:`Checkpointer.restore_newest` skips it), and a checkpoint that does not
restore (a truncated or garbage file, a missing item, an empty step folder).
:meth:`Checkpointer.restore_newest` walks back from the newest step to the newest one that
restores and is finite, and moves each one it passes into ``<directory>_damaged/`` (nothing a
user saved is deleted), saying why in one line. Rolling back past intact checkpoints (after a
divergence) moves the newer ones into ``<directory>_superseded/`` once an older one restored.
Tools that only read a run's weights (:meth:`Checkpointer.restore_params_newest`: export,
generation, fine-tuning from a run) walk back the same way but move nothing. A checkpoint
whose fp8_adamw state has an older layout (``meta["opt_state_layout"]``, absent before
layout 2) is refused with :class:`StateLayoutError` and left where it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from coat_jax.core.adam import STATE_LAYOUT, ScaleByFp8AdamState

__all__ = ["Checkpointer", "NonFiniteStateError", "Restored", "StateLayoutError", "all_finite"]


class NonFiniteStateError(ValueError):
    """A state holding NaN or Inf was about to be saved."""


class StateLayoutError(ValueError):
    """A checkpoint holds fp8_adamw state in a layout this version does not read."""


def _holds_fp8_adam(opt_state) -> bool:
    is_adam = lambda s: isinstance(s, ScaleByFp8AdamState)
    return any(is_adam(s) for s in jax.tree.leaves(opt_state, is_leaf=is_adam))


@jax.jit
def _all_finite(leaves):
    flags = [jnp.isfinite(x).all() for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.bool_(True)


def all_finite(*trees) -> bool:
    """Whether every floating-point value in ``trees`` is finite (one jitted reduction, run
    where the arrays are; FP8 codes included)."""
    return bool(_all_finite(jax.tree.leaves(trees)))


def _abstract(tree):
    """Restore target: shapes, dtypes and shardings of ``tree`` (arrays or abstract).

    A leaf without a sharding (``jax.eval_shape``'s) is read onto this process's first device:
    left to orbax, it would take the sharding the checkpoint was saved with, which names the
    saving run's devices (a run on 8 GPUs could then be exported only on 8 GPUs)."""
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def target(leaf):
        leaf = ocp.utils.to_shape_dtype_struct(leaf)
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
            leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here)
        return leaf

    return jax.tree.map(target, tree)


_READ_ERRORS = ("Encountered error while reading", "Event loop is closed")
_failed_folders: set[str] = set()
_echo_filters_installed = False


def _is_read_echo(error) -> bool:
    """Whether ``error`` echoes a failed restore: orbax's read error, or any error that names
    a checkpoint folder whose restore already failed (TensorStore's own, in a future nobody
    awaited any more)."""
    text = str(error)
    return text.startswith(_READ_ERRORS) or any(f in text for f in _failed_folders)


def _quiet_failed_reads(folder: str) -> None:
    """Silences the echoes of a failed restore of ``folder``, once it has been reported in one
    line: the reads orbax still had in flight fail later, in other threads and at garbage
    collection, each printing a screenful (the TensorStore spec of every array)."""
    _failed_folders.add(folder)
    _drop_read_echoes()


def _drop_read_echoes() -> None:
    """Installs (once) the hooks that drop what :func:`_is_read_echo` recognises; everything
    else prints as before. In place before a restore starts: the reads a failing restore
    abandons can complete, and their callbacks fail on asyncio's closed loop ("Event loop is
    closed", through ``sys.unraisablehook``), before the restore itself has raised."""
    global _echo_filters_installed
    if _echo_filters_installed:
        return
    _echo_filters_installed = True
    previous = sys.unraisablehook

    def unraisable(u):
        if not _is_read_echo(u.exc_value):
            previous(u)

    class DropReadErrors(logging.Filter):
        def filter(self, record):
            error = record.exc_info[1] if record.exc_info else None
            return error is None or not _is_read_echo(error)

    sys.unraisablehook = unraisable
    logging.getLogger("asyncio").addFilter(DropReadErrors())


def _first_line(e: BaseException) -> str:
    """The root cause's type and first line (TensorStore's names the file and what is wrong;
    orbax's wrapper prints a spec)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_newest` found.

    Attributes:
      step: the step restored.
      params, opt_state: the state, laid out like the requested trees.
      meta: the JSON item (``step``, ``seed``, ``data_position``, ``config`` where saved).
      skipped: ``(step, reason, moved_to)`` of each newer checkpoint that was passed over.
    """

    step: int
    params: object
    opt_state: object
    meta: dict
    skipped: tuple[tuple[int, str, str], ...]


class Checkpointer:
    """Saves and restores training state under ``<directory>/<step>``.

    Args:
      directory: checkpoint folder (created if missing).
      keep: how many of the newest checkpoints to keep.
      async_save: write in the background (``wait()`` blocks until done).
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.damaged_directory = self.directory + "_damaged"
        self.superseded_directory = self.directory + "_superseded"
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
        """Saves ``step`` (asynchronously).

        Raises:
          NonFiniteStateError: ``params`` or ``opt_state`` holds a NaN or Inf (nothing written).
        """
        if not all_finite(params, opt_state):
            raise NonFiniteStateError(
                f"step {step}: the parameters or optimizer state hold NaN or Inf; not saved"
            )
        self._manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(dict(meta, step=step, opt_state_layout=STATE_LAYOUT)),
            ),
        )

    def restore(self, step: int, params_like, opt_state_like):
        """``(params, opt_state, meta)`` of ``step``, laid out like the given (abstract) trees."""
        _drop_read_echoes()
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like)),
                opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored.params, restored.opt_state, restored.meta

    def read_meta(self, step: int) -> dict:
        """Only the JSON item of ``step`` (cheap: no array is read)."""
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return self._manager.restore(step, args=args).meta

    def restore_newest(self, params_like, opt_state_like, log=print, at_most: int | None = None):
        """The newest checkpoint that restores into the given trees and holds only finite
        values, as a :class:`Restored`; ``None`` when none does.

        Each one that fails (orbax cannot read it, or it holds NaN / Inf) is moved to
        :attr:`damaged_directory` and reported through ``log`` in one line. ``at_most``: roll
        back to this step or before it (a run that diverged); once one of those restores, the
        newer checkpoints are moved to :attr:`superseded_directory`, each said in one line
        (when none restores they stay where they are).
        """
        skipped = []
        check_layout = _holds_fp8_adam(opt_state_like)
        steps = sorted(self.all_steps(), reverse=True)
        newer = [s for s in steps if at_most is not None and s > at_most]
        for step in steps[len(newer) :]:
            if check_layout:
                self.check_layout(step)
            try:
                params, opt_state, meta = self.restore(step, params_like, opt_state_like)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is passed over
                _quiet_failed_reads(self._step_folder(step))
                reason = _first_line(e)
            else:
                if all_finite(params, opt_state):
                    for later in newer:
                        moved = self._move_aside(later, self.superseded_directory)
                        log(f"Checkpoint {later} set aside (newer than config.resume_step="
                            f"{at_most}); moved to {moved}")  # fmt: skip
                    return Restored(step, params, opt_state, meta, tuple(skipped))
                reason = "holds NaN or Inf"
            moved = self._move_aside(step, self.damaged_directory)
            log(f"Checkpoint {step} skipped ({reason}); moved to {moved}")
            skipped.append((step, reason, moved))
        return None

    def restore_params_newest(self, params_like, log=print, step: int | None = None):
        """``(step, params)``: the params of checkpoint ``step``, or, when ``step`` is None, of
        the newest checkpoint whose params restore (each newer one that does not is said in
        one line through ``log``). Read-only: nothing is moved (a tool reading another run's
        checkpoints leaves them as they are).

        Raises:
          FileNotFoundError: no checkpoint (or no checkpoint ``step``).
          ValueError: ``step`` does not restore, or none does (one line naming the folder).
        """
        steps = sorted(self.all_steps(), reverse=True)
        if step is not None and step not in steps:
            kept = ", ".join(map(str, sorted(steps))) or "none"
            raise FileNotFoundError(f"{self.directory}: no checkpoint {step} (kept: {kept})")
        if not steps:
            raise FileNotFoundError(f"{self.directory}: no checkpoint")
        tried = []
        for candidate in [step] if step is not None else steps:
            try:
                return candidate, self.restore_params(candidate, params_like)
            except Exception as e:  # noqa: BLE001 - an unreadable checkpoint: say it, go back
                _quiet_failed_reads(self._step_folder(candidate))
                reason = _first_line(e)
            tried.append(str(candidate))
            if step is None and candidate != steps[-1]:
                log(f"Checkpoint {self.directory}/{candidate} does not restore ({reason}); "
                    "trying the one before it")  # fmt: skip
        if step is not None:
            raise ValueError(f"checkpoint {self.directory}/{step} does not restore ({reason})")
        raise ValueError(f"{self.directory}: no checkpoint restores (tried {', '.join(tried)}; "
                         f"the oldest: {reason})")  # fmt: skip

    def _step_folder(self, step: int) -> str:
        """``<directory>/<step>/``, with the separator (so step 2 does not name step 20)."""
        return os.path.join(self.directory, str(step), "")

    def check_layout(self, step: int) -> None:
        """Raises :class:`StateLayoutError` if ``step`` holds fp8_adamw state in another layout
        than :data:`coat_jax.core.adam.STATE_LAYOUT` (nothing is moved: the checkpoint is
        intact, only older than this code). A meta that cannot be read passes: the restore
        that follows says what is wrong with it."""
        try:
            saved = self.read_meta(step).get("opt_state_layout", 1)
        except Exception:  # noqa: BLE001 - a damaged checkpoint: restore_newest reports it
            _quiet_failed_reads(self._step_folder(step))
            return
        if saved != STATE_LAYOUT:
            raise StateLayoutError(
                f"checkpoint {self.directory}/{step} holds fp8_adamw state layout {saved} "
                f"(coat-jax before 2026-12-01: FP8 codes shaped (*lead, groups, size)); this "
                f"coat-jax reads layout {STATE_LAYOUT}: resume it with the coat-jax that wrote "
                "it, or start a new run from its weights (config.init_from=<its workdir>)"
            )

    def _move_aside(self, step: int, folder: str) -> str:
        """Moves step ``step``'s folder into ``folder`` (process 0; all wait)."""
        source = os.path.join(self.directory, str(step))
        target = os.path.join(folder, str(step))
        suffix = 1
        while os.path.exists(target):
            target = os.path.join(folder, f"{step}.{suffix}")
            suffix += 1
        if jax.process_index() == 0:
            os.makedirs(folder, exist_ok=True)
            shutil.move(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"coat_jax_checkpoint_aside_{step}")
        self._manager.reload()
        return target

    def restore_params(self, step: int, params_like):
        """Only the params of ``step`` (to fine-tune from a run, or to export it)."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params_like)))
        _drop_read_echoes()
        return self._manager.restore(step, args=args).params

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
