r"""Next-token cross-entropy of a linear head, computed a chunk of positions at a time.

The full logits of a step are ``tokens x vocab`` fp32 values, and their gradient as many again:
Llama-2 (32,000 words) holds 2 x 262 MB per 2048-token sequence beyond the saved activations.
:func:`chunked_cross_entropy` never materializes them: it scans over chunks of ``chunk``
positions (all sequences of the batch at once), and for each chunk computes

.. math::

   \ell_c = \sum_{(b, t) \in c} w_{bt} \left(\operatorname{logsumexp}_v z_{btv} - z_{bt y_{bt}}
   \right), \qquad z = \operatorname{logits}(x_c),

under ``jax.checkpoint``: backward recomputes a chunk's logits from its hidden states, so at
any time one chunk's logits (and their gradient) exist. The result is
:math:`\sum_c \ell_c / \max(\sum w, 1)` (with ``w = 1`` where no weights are given: the mean),
the same as ``optax.softmax_cross_entropy_with_integer_labels`` on the whole logits up to
the order of fp32 sums.

Gradients of arrays the logits function closes over (the head) accumulate across chunks in
their own dtype: pass it fp32 and cast inside (as :meth:`coat_jax.models.llama.Llama` does).
Chunks run along the sequence axis, so a batch axis split over devices stays split.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

__all__ = ["chunked_cross_entropy"]


def chunked_cross_entropy(
    logits_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None,
    chunk: int,
) -> jax.Array:
    """Weighted mean cross-entropy of ``logits_fn(x)`` against ``targets``, chunk by chunk.

    Args:
      logits_fn: ``(B, c, h) -> (B, c, vocab)`` logits (fp32) of a chunk of hidden states.
      x: hidden states ``(B, T, h)``.
      targets: int labels ``(B, T)``.
      weights: ``(B, T)`` weights of the positions (a loss mask), or ``None`` (all 1).
      chunk: positions per chunk (a positive int); ``T`` is padded to a multiple of it with
        weight-0 positions.

    Returns:
      The scalar loss (fp32).
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunked_cross_entropy: chunk must be a positive int, got {chunk!r}")
    if x.ndim != 3 or targets.shape != x.shape[:2]:
        raise ValueError(
            f"chunked_cross_entropy: x (B, T, h) and targets (B, T), got {x.shape} and "
            f"{targets.shape}"
        )
    b, t, _ = x.shape
    w = jnp.ones((b, t), jnp.float32) if weights is None else weights.astype(jnp.float32)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        targets, w = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, w))

    def by_chunk(a):  # (B, n * chunk, ...) -> (n, B, chunk, ...): scanned over n
        return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk_loss(xc, tc, wc):
        losses = optax.softmax_cross_entropy_with_integer_labels(logits_fn(xc), tc)
        return jnp.sum(losses * wc)

    def step(total, inputs):
        return total + chunk_loss(*inputs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), tuple(map(by_chunk, (x, targets, w))))
    denominator = float(b * t) if weights is None else jnp.maximum(jnp.sum(w), 1.0)
    return total / denominator
