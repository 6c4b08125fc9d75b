"""Timing and device memory: the one way the trainer, the planner, the kernels' autotuner and
every benchmark under ``bench/`` read them.

* :func:`time_loop` times ``carry = step(carry)`` (a train step threading donated state, or a
  stateless call), waiting for the device; :func:`time_calls` is the stateless case.
* :func:`kernel_time` times one call's device kernels (CUPTI on a GPU, else host time).
* :func:`device_memory` reads the allocator's limit and peak over a set of devices (the
  fullest device's peak, the smallest limit: what decides whether a sharded step fits).
* :func:`allocator_settings` are the environment variables that decide the allocator (every
  memory figure is reported beside them).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax

__all__ = [
    "ALLOCATOR_VARIABLES",
    "DeviceMemory",
    "Timing",
    "allocator_settings",
    "device_memory",
    "kernel_time",
    "time_calls",
    "time_loop",
]

ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
"""Always reported (``"default"`` where unset); ``XLA_PYTHON_CLIENT_ALLOCATOR`` when set."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall times of timed iterations, in milliseconds per call.

    Attributes:
      times_ms: one entry per timed iteration (each the mean of its ``inner`` calls).
    """

    times_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)


def time_loop(step, carry, *, warmup: int = 1, iters: int = 10, inner: int = 1):
    """Runs ``carry = step(carry)`` ``warmup`` times untimed, then ``iters`` timed iterations
    of ``inner`` calls each, waiting for the device (``jax.block_until_ready``) after each.

    Returns:
      ``(Timing, carry)``: the times and the last carry (a train step's new state).
    """
    if iters < 1 or inner < 1 or warmup < 0:
        raise ValueError(f"time_loop: need iters, inner >= 1 and warmup >= 0, got "
                         f"{iters}, {inner}, {warmup}")  # fmt: skip
    for _ in range(warmup):
        carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(inner):
            carry = step(carry)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return Timing(tuple(times)), carry


def time_calls(fn, *args, warmup: int = 1, iters: int = 10, inner: int = 1) -> Timing:
    """:func:`time_loop` of ``fn(*args)`` (its outputs are dropped)."""
    return time_loop(lambda _: fn(*args), None, warmup=warmup, iters=iters, inner=inner)[0]


def kernel_time(fn, *args, iters: int = 20, inner: int = 5) -> tuple[float, str]:
    """``(median ms, "cupti" | "host")`` of ``fn(*args)``: the summed time of every kernel the
    call launches (padding, transposes, epilogue fusions included) from CUPTI where
    ``jax.experimental.mosaic.gpu.profiler`` works (a GPU), else :func:`time_calls`' host time
    of ``inner`` back-to-back calls."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(fn, iterations=iters)(*args)
        return float(statistics.median(times)), "cupti"
    except Exception as e:  # noqa: BLE001 (no CUPTI here: fall back, saying why)
        print(f"  (CUPTI timing unavailable: {type(e).__name__}: {e}; host timing)")
        return time_calls(fn, *args, iters=iters, inner=inner).median_ms, "host"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Allocator figures over a set of devices, in bytes; ``None`` where a device does not
    report them (a CPU).

    Attributes:
      limit: the smallest ``bytes_limit`` (what the allocator may use on each device).
      peak: the largest ``peak_bytes_in_use`` (the fullest device's peak since it started).
      in_use: the largest ``bytes_in_use`` now.
    """

    limit: int | None
    peak: int | None
    in_use: int | None


def device_memory(devices=None) -> DeviceMemory:
    """:class:`DeviceMemory` of ``devices`` (default: this process's local devices)."""
    stats = [d.memory_stats() or {} for d in (devices or jax.local_devices())]

    def read(key, pick):
        values = [s.get(key) for s in stats]
        return None if not values or None in values else int(pick(values))

    return DeviceMemory(read("bytes_limit", min), read("peak_bytes_in_use", max),
                        read("bytes_in_use", max))  # fmt: skip


def allocator_settings() -> dict[str, str]:
    """The allocator's environment variables: :data:`ALLOCATOR_VARIABLES` as set
    (``"default"`` where unset), and ``XLA_PYTHON_CLIENT_ALLOCATOR`` if set."""
    settings = {name: os.environ.get(name, "default") for name in ALLOCATOR_VARIABLES}
    if "XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ:
        settings["XLA_PYTHON_CLIENT_ALLOCATOR"] = os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"]
    return settings
