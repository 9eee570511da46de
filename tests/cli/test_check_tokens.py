"""``gradaccum check`` on token models: --vocab draws token ids, token-cross-entropy weights by items."""

import torch

from gradaccum.cli import check as cli_check
from gradaccum.cli import main
from gradaccum.torch.check import losses

FACTORY = """
import torch
from torch import nn

VOCAB = 13


class ClassesFirst(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids).transpose(1, 2)  # [batch, vocab, seq]: what cross_entropy reads


def lm():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def lm_classes_first():
    return ClassesFirst(lm())
"""


def padded_sample(path):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 13, (8, 6), generator=gen)
    targets = torch.randint(0, 13, (8, 6), generator=gen)
    for i, length in enumerate((1, 2, 6, 6, 3, 1, 5, 4)):  # 3, 12, 4, 9 tokens per micro-batch
        targets[i, length:] = -100
    torch.save({"inputs": ids, "targets": targets}, path)


def user_module(tmp_path, monkeypatch):
    (tmp_path / "usertokens.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_vocab_draws_token_ids_for_an_embedding(capsys, tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch)
    assert main(["check", "--model", "usertokens:lm", "--input-shape", "6", "--vocab", "13",
                 "--loss", "token-cross-entropy"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "EQUIVALENT: all 3 tensors agree" in out and "Item-weighted" in out
    assert "over its 192 items" in out  # 4 x 8 sequences of 6 random tokens, none ignored


def test_padded_sample_is_equivalent_only_when_item_weighted(capsys, tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch)
    padded_sample(tmp_path / "tokens.pt")
    # Item-weighted: the mean over all 28 tokens, as the full batch computes it.
    assert main(["check", "--model", "usertokens:lm", "--sample", "tokens.pt",
                 "--loss", "token-cross-entropy"]) == 0
    assert "over its 28 items" in capsys.readouterr().out.replace("\n", " ")
    # The same model and tokens under a plain mean loss per micro-batch: not equivalent.
    assert main(["check", "--model", "usertokens:lm_classes_first", "--sample", "tokens.pt",
                 "--loss", "cross-entropy"]) == 1
    out = capsys.readouterr().out.replace("\n", " ")
    assert "NOT EQUIVALENT" in out and "let the loss return (loss, n_items)" in out


def test_vocab_usage_errors_exit_2(capsys, tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch)
    padded_sample(tmp_path / "tokens.pt")
    for argv, message in [
        (["--model", "usertokens:lm", "--vocab", "13"], "--vocab draws token ids of --input-shape"),
        (["--model", "usertokens:lm", "--sample", "tokens.pt", "--vocab", "13"], "holds its own"),
        (["--model", "usertokens:lm", "--input-shape", "6", "--vocab", "0"], "vocab"),
    ]:
        assert main(["check", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_the_command_offers_the_checkers_losses():
    # The command line keeps its own copy so that building the parser imports no torch module.
    assert cli_check.LOSSES == losses.LOSSES


HF_FACTORY = """
import transformers


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))
"""


def test_a_hugging_face_batch_of_keyword_arguments_with_its_own_loss(capsys, tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("transformers")
    (tmp_path / "hfnets.py").write_text(HF_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (8, 16), generator=gen)
    mask = (torch.arange(16) < torch.randint(1, 17, (8,), generator=gen)[:, None]).long()
    ids = ids * mask
    torch.save({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)},
               tmp_path / "hf.pt")
    assert main(["check", "--model", "hfnets:gpt2", "--sample", "hf.pt", "--loss", "causal-lm"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "The loss is float32 while the model is float64" in out and "EQUIVALENT: all" in out
