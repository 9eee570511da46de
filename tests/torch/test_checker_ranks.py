"""The checker across 2 gloo ranks: DDP-wrapped processes on the CPU against one process on the
full batch, and what breaks equivalence there named (BatchNorm, unused parameters, no items)."""

import pytest
import torch
from torch import nn

from gradaccum import check_equivalence, count_tokens

VOCAB = 13


class HalfUsed(nn.Module):
    """A head the loss never uses: DDP waits for its gradients."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


class FailsOnRanks(nn.Module):
    """Raises in its forward only inside a process group: the error of a rank."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        if torch.distributed.is_initialized():
            raise RuntimeError(f"boom on rank {torch.distributed.get_rank()}")
        return self.lin(x)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def with_batchnorm():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def token_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def token_loss(out, targets):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)), count_tokens(targets)


def padded(lengths):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (len(lengths), 5), generator=gen)
    labels = torch.randint(0, VOCAB, (len(lengths), 5), generator=gen)
    for i, n in enumerate(lengths):
        labels[i, n:] = -100
    return ids, labels


def text(report):
    return str(report).replace("\n", " ")


def test_an_mlp_on_two_ranks_is_equivalent_to_one_process():
    report = check_equivalence(mlp, (4,), 2, micro_batch=2, world_size=2)
    assert report.equivalent, str(report)
    assert report.settings["world_size"] == 2 and report.settings["batch"] == 8
    assert report.settings["rank_spread"] < 1e-15
    assert max(d.rel for d in report.diffs) < 1e-12
    assert "against 2 DDP ranks (gloo processes) of 2 micro-batches of 2 each" in text(report)


def test_a_token_model_is_weighted_over_every_ranks_tokens():
    # Rank 0 holds 3 + 12 tokens, rank 1 holds 4 + 9: each rank's own mean would be wrong.
    ids, labels = padded((1, 2, 5, 5, 3, 1, 5, 4))
    report = check_equivalence(token_model, ids, 2, targets=labels, loss=token_loss, world_size=2)
    assert report.equivalent, str(report)
    assert report.settings["micro_n_items"] == [3, 10, 4, 9]


def test_batchnorm_across_ranks_is_named_with_syncbatchnorm():
    report = check_equivalence(with_batchnorm, (4,), 1, micro_batch=4, world_size=2)
    assert not report.equivalent
    assert [(h.module, h.kind) for h in report.hazards] == [("1", "BatchNorm1d")]
    assert "SyncBatchNorm" in report.hazards[0].fix and "sync=True" in report.hazards[0].fix
    assert "DDP broadcasts rank 0's buffers" in report.hazards[0].problem


def test_unused_parameters_are_named_and_find_unused_parameters_fixes_them():
    report = check_equivalence(HalfUsed, (4,), 1, micro_batch=4, world_size=2)
    assert not report.equivalent
    assert [(h.module, h.kind) for h in report.hazards] == [("unused", "Linear")]
    assert "find_unused_parameters=True" in report.hazards[0].fix
    assert report.settings["rank_spread"] > 1e-3  # no gradient was all-reduced: the ranks split
    fixed = check_equivalence(HalfUsed, (4,), 1, micro_batch=4, world_size=2,
                              ddp_kwargs={"find_unused_parameters": True})
    assert fixed.equivalent, str(fixed)


def test_a_rank_without_items_is_named_before_any_process_starts():
    ids, labels = padded((2, 3, 0, 0))  # rank 1 holds two sequences without a label
    report = check_equivalence(token_model, ids, 1, targets=labels, loss=token_loss, world_size=2)
    assert not report.equivalent
    assert [(h.module, h.kind) for h in report.hazards] == [("(rank 1, micro-batch 0)", "no items")]


def test_a_rank_that_raises_ends_the_check_with_its_error():
    from gradaccum.torch.check.spawn import RankError

    with pytest.raises(RankError, match=r"rank 0: RuntimeError: boom on rank 0") as err:
        check_equivalence(FailsOnRanks, (4,), 1, micro_batch=2, world_size=2)
    assert err.value.rank == 0 and "Traceback" in str(err.value)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"world_size": 0}, ValueError, "world_size"),
    ({"world_size": 2, "device": "meta"}, ValueError, "device must be 'cpu'"),
    ({"world_size": 3}, ValueError, r"world_size=3 x steps=2"),
    ({"ddp_kwargs": {"find_unused_parameters": True}}, ValueError, "ddp_kwargs"),
    ({"world_size": 2, "loss": lambda out, t: nn.functional.mse_loss(out, t)}, TypeError,
     "loss must be picklable"),
])
def test_bad_rank_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_equivalence(mlp, torch.randn(8, 4), 2, **kwargs)
