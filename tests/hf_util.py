"""Helpers of the tests that compare against transformers: random models saved as Hugging Face
folders, and their fp32 logits. Imported only where torch and transformers are installed."""

import numpy as np
import torch


def save_random(model, path, seed=0):
    """``model`` (a transformers causal LM) with random weights (norm weights near 1, others
    N(0, 0.1)) saved to ``path``; returns it in fp32, eval mode."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
