"""Fine-tune a Hugging Face Llama on prompt/response pairs, loss on the responses only.

  python train.py --config configs/llama_finetune.py \\
      --config.init_from=/path/to/Llama-3.2-1B --config.data.source=pairs.jsonl

``init_from``'s ``config.json`` sets the model shape and its ``tokenizer.json`` the tokenizer;
``data.source`` is a ``.jsonl`` of ``{"prompt": ..., "response": ...}`` records (keys
``data.prompt_key`` / ``data.response_key``), one example per row of ``seq_len + 1`` tokens.
Export the result with ``python -m coat_jax.tools.export_hf --workdir runs/finetune --out DIR``.
"""

from coat_jax.training.configs import base_config


def get_config():
    config = base_config()
    config.init_from = ""  # required: a Hugging Face Llama folder or a coat-jax run
    config.data.format = "prompt_response"
    config.data.source = "pairs.jsonl"
    config.batch_size, config.seq_len, config.steps = 8, 512, 200
    config.optimizer.update(lr=2e-5, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0)
    config.log_interval, config.eval_interval, config.checkpoint_interval = 10, 50, 100
    config.eval_batches = 2
    config.workdir = "runs/finetune"
    return config
