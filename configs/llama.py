"""Default config: runs anywhere. On a CPU, a 3.0M-parameter Llama on the embedded corpus
(about 4 minutes on 2 cores); on a GPU, an 85M-parameter one (768 wide, 12 layers).
Override anything with ``--config.key=value``."""

import jax

from coat_jax.training.configs import base_config


def get_config():
    config = base_config()
    config.workdir = "runs/llama"
    if jax.default_backend() == "cpu":
        config.model.update(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)
        config.batch_size, config.seq_len, config.steps = 16, 128, 400
    else:
        config.model.update(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048)
        config.batch_size, config.seq_len, config.steps = 32, 1024, 2000
        config.optimizer.lr = 1e-3
        config.log_interval, config.eval_interval, config.checkpoint_interval = 50, 250, 500
    return config
