"""Stopping a run cleanly when a scheduler or a user asks: SIGTERM and SIGINT (Ctrl-C).

The first signal only sets a flag; the training loop polls :meth:`StopRequest.should_stop`
after each step, and when it answers yes the run writes a checkpoint at that step and exits
with status 0, so a preempted job resumes where it stopped. A second signal ends the process
at once with that signal's default action (what a scheduler's follow-up SIGKILL would do).

Several processes must stop at the same step, since a checkpoint save is collective and a
scheduler may signal only some of them: each process contributes its flag to an any-reduction
over all devices, dispatched with the step and read one step later, so no process waits on
another's host and the device stream never stalls. All processes read the same reduced value
at the same step and stop together. One process reads its own flag directly.
"""

from __future__ import annotations

import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["StopRequest"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Catches SIGTERM and SIGINT while active (a context manager), and agrees across
    processes on the step to stop at.

    Attributes:
      signal_name: the name of the first signal received (``None`` before one).
    """

    def __init__(self, announce=print):
        self.signal_name: str | None = None
        self._announce = announce
        self._previous = {}
        self._pending = None  # the reduction dispatched one step ago (several processes)
        if jax.process_count() > 1:
            devices = np.array(jax.devices())
            mesh = Mesh(devices, ("all",))
            self._flags = NamedSharding(mesh, P("all"))
            self._local = len(jax.local_devices())
            self._any = jax.jit(jnp.any, out_shardings=NamedSharding(mesh, P()))

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signal_name is not None:  # the second: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name
        self._announce(f"{self.signal_name} received: stopping after this step with a "
                       "checkpoint (send it again to exit at once)")  # fmt: skip
        sys.stdout.flush()

    def should_stop(self) -> bool:
        """Whether the run stops now. With one process: whether a signal arrived. With several:
        whether any process had received one by the previous call (the same answer on all)."""
        requested = self.signal_name is not None
        if jax.process_count() == 1:
            return requested
        local = np.full((self._local,), requested)
        flags = jax.make_array_from_process_local_data(self._flags, local)
        previous, self._pending = self._pending, self._any(flags)
        return previous is not None and bool(previous)

    @property
    def reason(self) -> str:
        """What asked this process to stop: its signal, or another process's."""
        return self.signal_name or "a signal to another process"
