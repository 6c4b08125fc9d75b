"""A 113.7M-parameter Llama on the whole standard-library source tree (byte tokenizer), sized for
bench/fidelity.py: configs/llama.py's GPU shape (dim 768, 12 heads, SwiGLU 2048) with 16 layers,
batch 16 x 512 tokens, 2000 steps (16.4M tokens, about half a pass over the ~30 MB of training
bytes of ``data.source="stdlib_all"``: the first H200 run used the 4.5 MB ``"stdlib"`` corpus,
3.6 passes, and its train loss measured memorisation). Needs a GPU in practice; does not ask JAX
for its backend, so a driver can load it without touching the GPU."""

from coat_jax.training.configs import base_config


def get_config():
    config = base_config()
    config.model.update(dim=768, n_layers=16, n_heads=12, n_kv_heads=12, ffn_dim=2048)
    config.batch_size, config.seq_len, config.steps = 16, 512, 2000
    config.data.source = "stdlib_all"
    config.optimizer.update(lr=1e-3, warmup_steps=100)
    # train loss logged every 10 steps: bench/fidelity.py's final loss (the mean over the last
    # 10% of steps) then averages 20 logged steps, not 4
    config.log_interval, config.eval_interval, config.checkpoint_interval = 10, 250, 1000
    config.eval_batches = 8
    config.workdir = "runs/llama_114m"
    config.progress = False
    return config
