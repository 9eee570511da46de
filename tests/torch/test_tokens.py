"""Token-weighted losses over padded sequences: the window is the mean over its real tokens."""

import pytest
import torch

import gradaccum
from tests.reference import PAD, assert_params_close, clone_model, lm_loss, padded, tiny_lm


def run(weighted, dtype, steps=4, windows=3, micro=3, max_len=9):
    model = tiny_lm(dtype)
    ref = clone_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    acc = gradaccum.Accumulator(opt, steps)
    for w in range(windows):
        tokens, targets = padded(steps * micro, max_len, seed=w)
        for tb, yb in zip(tokens.split(micro), targets.split(micro), strict=True):
            n = int((yb != PAD).sum()) if weighted else None
            acc.backward(lm_loss(model, tb, yb), n_items=n)
        ref_opt.zero_grad()
        lm_loss(ref, tokens, targets).backward()  # mean over every real token of the window
        ref_opt.step()
    return model, ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_weighted_window_equals_full_batch(dtype):
    model, ref = run(weighted=True, dtype=dtype)
    assert_params_close(model, ref, dtype)


def test_loss_over_n_is_not_the_token_mean():
    # The known pain this fixes: averaging per micro-batch over-weights short sequences.
    model, ref = run(weighted=False, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, torch.float64)


def test_item_count_as_a_tensor():
    model = tiny_lm(torch.float64)
    ref = clone_model(model)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    tokens, targets = padded(6, 7, seed=3)
    for tb, yb in zip(tokens.split(3), targets.split(3), strict=True):
        acc.backward(lm_loss(model, tb, yb), n_items=(yb != PAD).sum())
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    lm_loss(ref, tokens, targets).backward()
    opt.step()
    assert_params_close(model, ref, torch.float64)
