"""Helpers shared by the engine tests."""


def perturb(model, scale=0.05, seed=0):
    """Move every weight of ``model`` by seeded noise (in place); its new state dict."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.state_dict()
