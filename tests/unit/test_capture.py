"""capture_layers records block outputs equal to a manual walk through the blocks."""

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models.capture import capture_layers
from dllm.models.transformer import Transformer


def _model() -> Transformer:
    cfg = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, vocab_size=50)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def test_capture_equals_manual_block_walk() -> None:
    model = _model()
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).expand(2, 7)
    mask = AttentionMask(kind="causal")
    with capture_layers(model, [2, 0]) as cap:
        out = model(tokens, positions, mask)
    feats = cap.features()
    assert feats.shape == (2, 7, 64)
    # the last block's output, normed, is the final hidden state
    torch.testing.assert_close(model.norm(cap.outputs[2]), out.hidden_BLE)
    # block 0's output from a model cut after block 0
    cut = _model()
    del cut.layers[1:]
    with capture_layers(cut, [0]) as cap0:
        cut(tokens, positions, mask)
    torch.testing.assert_close(feats[..., 32:], cap0.outputs[0])
    # hooks are gone after the context
    assert all(not layer._forward_hooks for layer in model.layers)


def test_capture_rejects_layers_outside_the_model() -> None:
    with pytest.raises(ValueError, match="outside the model's 3 layers"), capture_layers(_model(), [3]):
        pass
