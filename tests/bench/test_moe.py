"""gradaccum.bench.moe: the references the MoE benchmark measures against agree with each other and
with Hugging Face, and its training data has the domain structure it claims."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from gradaccum.bench.moe import (
    TokenMoE,
    aux_terms,
    domain_batches,
    hand_loop,
    padded_batches,
    route_counts,
    tiny_qwen3_moe,
    two_pass_loop,
    window_aux,
    window_reference,
)


def trained(base, loop, windows):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        loop(model, window, opt)
    return model


def diff(a, b):
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).detach().abs().max()) for p, q in pairs)


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_moe()


def test_the_two_passes_by_hand_equal_the_whole_window_and_the_hugging_face_loop_does_not(qwen):
    windows = [padded_batches([3, 2, 3], 6, 32, seed=w) for w in range(2)]
    ref = trained(qwen, window_reference, windows)
    assert diff(trained(qwen, two_pass_loop, windows), ref) < 1e-12
    assert diff(trained(qwen, hand_loop, windows), ref) > 1e-4  # each micro-batch's own balance


def test_the_written_out_balancing_loss_is_hugging_faces_on_one_batch(qwen):
    batch = padded_batches([4], 6, 32, seed=5)[0]
    with torch.no_grad():
        out = qwen(**batch, output_router_logits=True)
        counts, rows = route_counts(out.router_logits, batch["attention_mask"], 8, 2)
        ours = window_aux(counts, rows, aux_terms(out.router_logits, batch["attention_mask"]))
    torch.testing.assert_close(ours.float(), out.aux_loss.float())


def test_each_micro_batch_holds_one_domain_and_the_domains_cycle():
    batches = domain_batches(8, 3, 10, 64, 4, seed=0)
    domains = [int(b["input_ids"].min()) // 16 for b in batches]
    assert all(int(b["input_ids"].max()) // 16 == d for b, d in zip(batches, domains, strict=True))
    assert sorted(domains[:4]) == sorted(domains[4:]) == [0, 1, 2, 3]


def test_the_token_model_routes_every_token_to_top_k_experts():
    model = TokenMoE(64, hidden=8, experts=4, top_k=2, layers=2)
    seen = []
    for router in model.routers:
        router.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert model(torch.randint(0, 64, (3, 5))).shape == (3, 5, 64)
    assert seen == [torch.Size([15, 4])] * 2
