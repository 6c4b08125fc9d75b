"""Assembling a training run from its config: the one place model, optimizer, mesh, shardings
and step are put together (``train.py``, ``bench/e2e.py`` and ``bench/profile_step.py`` call
:func:`assemble`; the planner reads the :class:`Run` it returns).

Nothing is allocated on a device: parameters are abstract until :meth:`Run.create` makes them
(fresh, or read from ``config.init_from``) in their shards, or a checkpoint is restored into
:meth:`Run.abstract_state`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from coat_jax.models.llama import Llama, LlamaConfig, init_params
from coat_jax.ops import master_weights, sharding
from coat_jax.training import configs, data, finetune, parallel, step
from coat_jax.training.optimizer import OptimizerSetup, make_fused_update, make_optimizer
from coat_jax.training.parallel import Placement

__all__ = ["Run", "assemble"]


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a training run is made of, before any array exists.

    Attributes:
      config: the (validated) config it was assembled from.
      model: the model config (shape, precision, FP8 recipe).
      tokenizer: the data tokenizer (``coat_jax.training.data``).
      graph: the model's ``nnx.GraphDef``.
      params: abstract parameters (``jax.ShapeDtypeStruct`` leaves in an ``nnx.State``).
      optimizer: the :class:`~coat_jax.training.optimizer.OptimizerSetup`.
      placement: where parameters, optimizer state and batches live on the mesh.
      train_step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``, jitted.
      loop_step: the same step on the flat list of ``(params, opt_state)``'s arrays
        (:class:`~coat_jax.training.step.FlatTrainStep`): what ``train.py``'s loop calls and
        the planner compiles (the tree call's Python made the 114M COAT loop on an H200 42%
        slower: 34.0 vs 23.9 ms a step).
      eval_step: ``(params, batch) -> loss``, jitted.
      fused_update: whether ``train_step`` runs the fused FP8 AdamW kernel.
      grad_dtype: the gradients' dtype, ``"float32"`` or ``"bfloat16"`` (``config.grad_dtype``
        with ``auto`` decided, :func:`~coat_jax.training.configs.resolve_grad_dtype`).
    """

    config: ml_collections.ConfigDict
    model: LlamaConfig
    tokenizer: Any
    graph: nnx.GraphDef
    params: nnx.State
    optimizer: OptimizerSetup
    placement: Placement
    train_step: Any
    loop_step: step.FlatTrainStep
    eval_step: Any
    fused_update: bool
    grad_dtype: str

    def batch_shape(self, batch_size: int | None = None) -> tuple[int, int, int]:
        """``(grad_accum, micro_batch, seq_len + 1)`` of a train batch of ``batch_size``
        sequences (default: the config's)."""
        c = self.config
        batch = c.batch_size if batch_size is None else batch_size
        return c.grad_accum, batch // c.grad_accum, c.seq_len + 1

    def abstract_batch(self, batch_size: int | None = None) -> jax.ShapeDtypeStruct:
        """A train batch's shape and dtype (what the step compiles for)."""
        return jax.ShapeDtypeStruct(self.batch_shape(batch_size), jnp.int32)

    def abstract_state(self):
        """``(params, opt_state)`` as shapes, dtypes and shardings: what the step compiles for
        and what a checkpoint is restored into."""
        opt_state = jax.eval_shape(self.optimizer.tx.init, self.params)
        return self.placement.abstract(self.params, opt_state)

    def create(self):
        """``(params, opt_state)`` on the devices, each array made in its shards: a new model
        from ``config.seed``, or ``config.init_from``'s weights; a fresh optimizer state. With
        BF16 master weights the fp32 weights are made first and split into BF16 parameters
        and remainders leaf by leaf (each fp32 array freed once split), the optimizer state is
        made from the parts (its remainders reuse theirs), and the arrays are repacked
        (:func:`~coat_jax.training.parallel.repack`: the freed fp32 weights would leave holes
        the step's temporary buffer cannot use; 13B at batch 4 on one H200 did not run
        without). Llama-2-7B with 16 bits: the fp32 weights plus one leaf's parts while
        splitting (27 GB), then the parts and the state (41 GB); splitting after the state was
        made peaked at 67.9 GB on an H200 (2026-12-02)."""
        shardings = self.placement.params
        if self.config.init_from:
            like = _with_dtype(self.params, jnp.float32)
            params = finetune.initial_params(self.config, like, shardings)
        else:
            params = init_params(self.model, self.config.seed, shardings)[1]
        tx, bits = self.optimizer.tx, self.optimizer.master_bits
        if bits is None:
            return params, self.placement.init_opt_state(tx, params)
        params, remainder = master_weights.split_leaf_by_leaf(params, bits)
        opt_state = master_weights.init_from_parts(tx.init, params, remainder,
                                                   self.placement.opt_state)  # fmt: skip
        return parallel.repack((params, opt_state))


def _with_dtype(params, dtype):
    """Abstract ``params`` with every float leaf in ``dtype``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)


def assemble(config: ml_collections.ConfigDict, *, devices=None) -> Run:
    """The :class:`Run` ``config`` describes, on ``devices`` (default: all of them).

    Call it under no mesh; use the steps under ``jax.set_mesh(run.placement.mesh)``.
    ``config.batch_size`` may be -1 (decided later by the planner); otherwise each
    micro-batch must split evenly over the mesh's ``data x fsdp`` devices.

    Raises:
      ValueError: naming the config key that cannot be built (vocabulary smaller than the
        tokenizer's, a mesh that does not fit the devices, a tensor axis that does not
        divide the heads, a batch that does not split).
    """
    tokenizer = data.load_tokenizer(config.data.tokenizer)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    model = configs.llama_config(config)
    graph, params = nnx.split(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))))
    optimizer = make_optimizer(config.optimizer, config.steps)
    if optimizer.master_bits is not None:  # the model holds the BF16 parts
        params = _with_dtype(params, jnp.bfloat16)
    try:
        mesh = sharding.make_mesh(**config.mesh, devices=devices)
    except ValueError as e:
        raise ValueError(f"config.mesh: {e}") from None
    tensor = mesh.shape["tensor"]
    if model.n_heads % tensor or model.kv_heads % tensor:  # else a head's columns split
        raise ValueError(
            f"config.mesh.tensor={tensor} must divide config.model.n_heads={model.n_heads} and "
            f"its key/value heads ({model.kv_heads}): heads are split whole over the tensor axis"
        )
    placement = parallel.make_placement(mesh, params, optimizer.tx)
    if config.batch_size != -1:
        micro = config.batch_size // config.grad_accum
        if micro % placement.batch_shards:
            raise ValueError(
                f"config.batch_size / grad_accum = {micro} examples per micro-batch must divide "
                f"over mesh data x fsdp = {placement.batch_shards} devices"
            )
    fused = make_fused_update(optimizer, placement)
    grad_dtype = configs.resolve_grad_dtype(config, fused is not None)
    make_step = lambda treedef=None: step.make_train_step(
        graph, optimizer.chain, placement, fused_update=fused,
        compiler_options=model.policy().compiler_options(), grad_dtype=grad_dtype,
        master_bits=optimizer.master_bits, update_in_backward=optimizer.update_in_backward,
        treedef=treedef,
    )  # fmt: skip
    state = jax.tree.structure((params, jax.eval_shape(optimizer.tx.init, params)))
    eval_step = step.make_eval_step(graph, placement)
    return Run(config, model, tokenizer, graph, params, optimizer, placement, make_step(),
               make_step(state), eval_step, fused is not None, grad_dtype)  # fmt: skip
