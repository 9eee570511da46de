"""Loss terms of different normalizers in one window (mb.term), and one accumulator stepping
another's partial window: each against the full batch in float64."""

import math

import pytest
import torch

import gradaccum

SPLITS = {"4x2": [2, 2, 2, 2], "2x4": [4, 4], "3+3+2": [3, 3, 2]}
BETA = 0.05  # the entropy bonus's coefficient
AUX = 0.3  # the auxiliary loss's coefficient


def batch(seed: int = 0):
    """8 sequences of 1 to 20 tokens, padded: features, targets, advantages and the mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 20, 3, 7, 12, 2, 16, 5])
    mask = (torch.arange(20)[None, :] < lengths[:, None]).double()
    x = torch.randn(8, 20, 4, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 3, (8, 20), generator=g)
    advantages = torch.randn(8, generator=g, dtype=torch.float64)
    return x, targets, advantages, mask


def per_token(model, x, targets, advantages):
    """A policy-gradient loss and the entropy, per token (GRPO's shape, without clipping)."""
    logp = torch.log_softmax(model(x), -1)
    policy = -logp.gather(-1, targets[..., None]).squeeze(-1) * advantages[:, None]
    entropy = -(logp.exp() * logp).sum(-1)
    return policy, entropy, model(x).mean().pow(2)  # the last: an auxiliary loss per micro-batch


def reference(model, data, sizes):
    """One SGD step on the window as one loss: the policy per sequence, the entropy bonus per
    token over the whole window, the auxiliary loss as the mean over its micro-batches."""
    x, targets, advantages, mask = data
    policy, entropy, _ = per_token(model, x, targets, advantages)
    loss = ((policy * mask).sum(-1) / mask.sum(-1)).mean() - BETA * (entropy * mask).sum() / mask.sum()
    aux = [per_token(model, xb, tb, ab)[2] for xb, tb, ab in zip(x.split(sizes), targets.split(sizes),
                                                                  advantages.split(sizes), strict=True)]
    loss = loss + AUX * torch.stack(aux).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
            p.grad = None
    return loss.detach()


def chunks(data, sizes):
    return list(zip(*(t.split(sizes) for t in data), strict=True))


def train_terms(model, data, sizes, *, tensor_counts=False):
    """The API: one accumulator, one backward per micro-batch of the three weighted terms."""
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), len(sizes))
    mask = data[3]
    sequences, tokens = mask.shape[0], mask.sum()
    if not tensor_counts:
        tokens = int(tokens)
    for x, targets, advantages, m in chunks(data, sizes):
        policy, entropy, aux = per_token(model, x, targets, advantages)
        n_tok = m.sum() if tensor_counts else int(m.sum())
        with acc.micro_batch() as mb:
            mb.backward(mb.term(((policy * m).sum(-1) / m.sum(-1)).mean(), len(x), total=sequences)
                        + mb.term(-BETA * (entropy * m).sum(), n_tok, total=tokens, reduction="sum")
                        + AUX * aux)
    assert acc.optimizer_steps == 1
    return acc


def params_of(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fresh():
    torch.manual_seed(3)
    return torch.nn.Linear(4, 3).double()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("tensor_counts", [False, True])
def test_terms_of_three_normalizers_match_the_full_batch(split, tensor_counts):
    sizes, data = SPLITS[split], batch()
    ref, model = fresh(), fresh()
    ref_loss = reference(ref, data, sizes)
    acc = train_terms(model, data, sizes, tensor_counts=tensor_counts)
    moved = (params_of(ref) - params_of(fresh())).abs().max()
    assert moved > 1e-2  # the step did something
    assert (params_of(model) - params_of(ref)).abs().max() < 1e-12
    assert abs(acc.window_loss - ref_loss) < 1e-12  # the window's loss is weighted like its gradient


@pytest.mark.parametrize("split", SPLITS)
def test_the_naive_form_is_off(split):
    # Negative twin: the block weighted by sequences, the entropy token mean inside it, the
    # auxiliary loss plainly added: the bonus is weighted by sequences, not by tokens.
    sizes, data = SPLITS[split], batch()
    ref, model = fresh(), fresh()
    reference(ref, data, sizes)
    train_naive(model, data, sizes)
    assert (params_of(model) - params_of(ref)).abs().max() > 1e-6


def train_naive(model, data, sizes):
    """The naive block: weighted by sequences, the entropy's own token mean inside it."""
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), len(sizes))
    for x, targets, advantages, m in chunks(data, sizes):
        policy, entropy, aux = per_token(model, x, targets, advantages)
        with acc.micro_batch(len(x)) as mb:
            mb.backward(((policy * m).sum(-1) / m.sum(-1)).mean() - BETA * (entropy * m).sum() / m.sum()
                        + AUX * aux)


def test_two_windows_and_a_term_beside_a_separate_forward():
    # Two windows in a row (the window's state clears), and a task with a forward of its own
    # backwarded on its own: still exact.
    data, sizes = batch(), [3, 5]
    ref, model = fresh(), fresh()
    for _ in range(2):
        reference(ref, data, sizes)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    for _ in range(2):
        for x, targets, advantages, m in chunks(data, sizes):
            with acc.micro_batch() as mb:
                policy, entropy, aux = per_token(model, x, targets, advantages)
                mb.backward(mb.term(((policy * m).sum(-1) / m.sum(-1)).mean(), len(x), total=8) + AUX * aux)
                _, entropy, _ = per_token(model, x, targets, advantages)
                mb.backward(mb.term(-BETA * (entropy * m).sum() / m.sum(), m.sum(), total=data[3].sum()))
    assert acc.optimizer_steps == 2
    assert (params_of(model) - params_of(ref)).abs().max() < 1e-12


def test_a_term_in_a_block_opened_with_n_items_is_refused_before_anything_changes():
    model = fresh()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    x, targets, advantages, _ = chunks(batch(), [4, 4])[0]
    with acc.micro_batch(4) as mb:
        policy, _, _ = per_token(model, x, targets, advantages)
        with pytest.raises(ValueError, match=r"mb.term\(total=8\) needs a block opened without n_items"):
            mb.term(policy.mean(), 4, total=8)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"n_items": 2, "total": 0}, ValueError, "total must be a finite number > 0, got 0"),
    ({"n_items": 2, "total": -3.0}, ValueError, r"total must be .* got -3.0"),
    ({"n_items": 2, "total": math.nan}, ValueError, "total must be .* got nan"),
    ({"n_items": 2, "total": "8"}, TypeError, "total must be a number > 0 or a 0-dim tensor, got '8'"),
    ({"n_items": 2, "total": True}, TypeError, "total must .* got True"),
    ({"n_items": 2, "total": torch.ones(2)}, ValueError, r"total must .* shape \(2,\)"),
    ({"total": 8}, ValueError, r"n_items=None, total=8\) with reduction='mean' needs n_items"),
    ({"n_items": 2, "total": 8, "reduction": "max"}, ValueError, "reduction must be 'mean' or 'sum'"),
])
def test_bad_term_arguments_are_named(kw, error, match):
    model = fresh()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    with acc.micro_batch() as mb, pytest.raises(error, match=match):
        mb.term(model(torch.ones(1, 4, dtype=torch.float64)).sum(), **kw)
    assert acc.micro_step == 1 and all(p.grad is None for p in model.parameters())


def test_a_closed_block_refuses_a_term():
    model = fresh()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    with acc.micro_batch() as mb:
        pass
    with pytest.raises(RuntimeError, match="with-block has ended"):
        mb.term(model(torch.ones(1, 4, dtype=torch.float64)).sum(), 1, total=2)


def test_flush_of_a_partial_window_holding_a_term_is_refused_and_discard_recovers():
    model = fresh()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 3)
    before = params_of(model)
    with acc.micro_batch() as mb:
        mb.backward(mb.term(model(torch.ones(2, 4, dtype=torch.float64)).sum(), 2, total=6))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"flush\(\) of a window holding 1 of 3 micro-batches and a term"):
        acc.flush()
    assert acc.micro_step == 1 and torch.equal(params_of(model), before)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    acc.discard()
    # A window of plain losses flushes as before.
    acc.backward(model(torch.ones(2, 4, dtype=torch.float64)).sum())
    assert acc.flush() and acc.optimizer_steps == 1


# --- two accumulators over the same parameters -------------------------------------------------

def test_two_accumulators_over_one_model_raise_naming_both_before_the_step():
    # The obvious attempt: one accumulator per loss term, each with its own normalizer.
    model = fresh()
    data, sizes = batch(), [4, 4]
    acc_policy = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    acc_entropy = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    before = params_of(model)
    parts = chunks(data, sizes)
    with pytest.raises(RuntimeError) as err:
        for x, targets, advantages, m in parts:
            policy, _, _ = per_token(model, x, targets, advantages)
            acc_policy.backward(((policy * m).sum(-1) / m.sum(-1)).mean(), len(x))
            _, entropy, _ = per_token(model, x, targets, advantages)
            acc_entropy.backward(-BETA * (entropy * m).sum(), m.sum(), reduction="sum")
    message = str(err.value)
    assert f"id {id(acc_policy):#x}" in message and f"id {id(acc_entropy):#x}" in message
    assert "holds a partial window" in message and "mb.term" in message
    assert torch.equal(params_of(model), before)  # nothing stepped
    # Refused at the second accumulator's first micro-batch, before its backward ran.
    assert acc_policy.micro_step == 1 and acc_entropy.micro_step == 0


def test_accumulators_over_disjoint_parameters_or_an_empty_window_step_freely():
    generator, critic = fresh(), fresh()
    acc_g = gradaccum.Accumulator(torch.optim.SGD(generator.parameters(), lr=0.5), 1)
    acc_c = gradaccum.Accumulator(torch.optim.SGD(critic.parameters(), lr=0.5), 2)
    x = torch.ones(2, 4, dtype=torch.float64)
    acc_c.backward(critic(x).sum())  # a partial window over other parameters
    assert acc_g.backward(generator(x).sum())
    # Over the same parameters, once the other's window is empty again (flushed or discarded).
    again = gradaccum.Accumulator(torch.optim.SGD(critic.parameters(), lr=0.5), 1)
    acc_c.discard()
    assert again.backward(critic(x).sum())


def test_a_dropped_accumulator_holds_nothing():
    model = fresh()
    x = torch.ones(2, 4, dtype=torch.float64)
    old = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    old.backward(model(x).sum())
    old.discard()
    del old
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 1)
    assert acc.backward(model(x).sum())


def test_a_dropped_accumulator_in_a_reference_cycle_holds_nothing():
    # Dropped with a partial window, but alive until the collector runs: not a conflict.
    model = fresh()
    x = torch.ones(2, 4, dtype=torch.float64)
    old = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    old.backward(model(x).sum())
    old.cycle = old
    del old
    model.zero_grad(set_to_none=True)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 1)
    assert acc.backward(model(x).sum())


# --- the totals are checked against the window's counts ----------------------------------------

@pytest.mark.parametrize("wrong", ["too small", "changes between micro-batches", "tensor too large"])
def test_a_total_that_is_not_the_windows_count_raises_at_the_boundary_and_steps_nothing(wrong):
    model = fresh()
    data, sizes = batch(), [4, 4]
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    before = params_of(model)
    with pytest.raises(ValueError, match=r"mb\.term #0") as err:
        for i, (x, targets, advantages, m) in enumerate(chunks(data, sizes)):
            total = {"too small": 4, "changes between micro-batches": 8 + i,
                     "tensor too large": torch.tensor(9.0)}[wrong]
            policy, _, _ = per_token(model, x, targets, advantages)
            with acc.micro_batch() as mb:
                mb.backward(mb.term(((policy * m).sum(-1) / m.sum(-1)).mean(), len(x), total=total))
    assert ("different totals" in str(err.value)) == (wrong == "changes between micro-batches")
    assert torch.equal(params_of(model), before) and acc.optimizer_steps == 0
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())  # a fresh window


def test_a_summed_term_without_counts_is_not_checked():
    # The negative twin: with n_items=None (allowed for a summed term) there is nothing to compare.
    model = fresh()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.5), 2)
    for x in batch()[0].split(4):
        with acc.micro_batch() as mb:
            mb.backward(mb.term(model(x).pow(2).sum(), total=123, reduction="sum"))
    assert acc.optimizer_steps == 1
