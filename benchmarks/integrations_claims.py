"""The figures of docs/INTEGRATIONS.md and LANGUAGE_MODELS.md, from the tests' own runs, as a results file.

The recipes' tests (tests/integrations/, tests/torch/test_terms.py) assert bounds; this script runs
the same set-ups and keeps the figures themselves: the Accelerate port against the example's loop
(float64 and transformers' float32 loss, fp16, a mid-window resume on a shuffled dataloader), the
Trainer (the checker, the count, the recipe's run), every TRL loss type (splits, TRL's own
accumulation, a generation batch feeding two windows), loss terms of different normalizers, and
docs/LANGUAGE_MODELS.md's recipes (Hugging Face GPT-2 and Llama, their mistakes, nanoGPT).

    python benchmarks/integrations_claims.py --json docs/results/integrations.json

Needs the test extras (accelerate, transformers); about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradaccum.bench.machine import describe_machine  # noqa: E402
from gradaccum.bench.results_file import write_results  # noqa: E402


def accelerate_figures(tmp: Path) -> dict[str, Any]:
    from tests.integrations import test_accelerate as acc
    from tests.integrations.common import max_diff
    from tests.integrations.common import tiny_gpt2 as tiny

    base = acc.gpt2()
    full = acc.train("run-clm-original", base, 16, 1)
    port = acc.train("run-clm", base, 4, 4)
    example = acc.train("run-clm-original", base, 4, 4)
    base32 = acc.gpt2(float64_loss=False)
    full32, port32 = acc.train("run-clm-original", base32, 16, 1), acc.train("run-clm", base32, 4, 4)
    fp16_base = tiny(torch.float32)
    fp16_full = acc.fp16_train(fp16_base, 16, 1, adapter=True)
    fp16_port = acc.fp16_train(fp16_base, 4, 4, adapter=True)
    resume = {}
    for name, options in {"default": {"seedable": False}, "seedable_set_epoch": {"seedable": True}}.items():
        _, resume[name], resume["moved"] = acc.resumed_against_uninterrupted(tmp / name, shuffle=True,
                                                                            **options)
    # The seedable sampler without set_epoch: every epoch draws the same order, the restart another.
    resume["seedable_without_set_epoch"] = _without_set_epoch(acc, tmp / "no-set-epoch")
    return {"settings": {"sequences": acc.SEQUENCES, "micro": 4, "steps": 4, "full_batch": 16},
            "moved": max_diff(full["model"], base), "optimizer_steps": port["completed_steps"],
            "port": max_diff(port["model"], full["model"]),
            "example": max_diff(example["model"], full["model"]),
            "port_float32_loss": max_diff(port32["model"], full32["model"]),
            "fp16": {"port": max_diff(fp16_port, fp16_full), "moved": max_diff(fp16_full, fp16_base)},
            "resume": resume}


def _without_set_epoch(acc: Any, tmp: Path) -> float:
    """The resume distance with the seedable sampler but the loop's set_epoch line removed."""
    real = acc.recipe
    line = "    train_dataloader.set_epoch(epoch)"
    assert line in real("run-clm-checkpoint")

    def recipe(name: str, *replace: Any) -> str:
        code = real(name, *replace)
        return code.replace(line, "    pass") if name == "run-clm-checkpoint" else code

    acc.recipe = recipe
    import tests.integrations.common as common

    real_common = common.recipe
    common.recipe = recipe
    try:
        return acc.resumed_against_uninterrupted(tmp, shuffle=True, seedable=True)[1]
    finally:
        acc.recipe, common.recipe = real, real_common


def trainer_figures(tmp: Path) -> dict[str, Any]:
    from tests.integrations import test_trainer as tr
    from tests.integrations.common import max_diff, run, tiny_gpt2

    batch = tr.collate(tr.padded_text(tr.SEQUENCES))
    with contextlib.redirect_stdout(io.StringIO()):
        good = run("trainer-check", {"model": tiny_gpt2(), "batch": batch})["report"]
        bad = run("trainer-check", {"model": tiny_gpt2(), "batch": batch},
                  ("count_tokens(labels, shift=True)", "count_tokens(labels)"))["report"]
    labels = batch["labels"]
    unshifted, shifted = int((labels != -100).sum()), int((labels[:, 1:] != -100).sum())
    base = tr.gpt2()
    full = tr.reference(base)
    recipe_run = tr.trainer_run(base, tmp / "recipe")
    unchecked = tr.trainer_run(base, tmp / "unchecked", ('model.loss_type = "ForCausalLM"', "pass"),
                               ("assert int(counted)", "assert True or int(counted)"))
    window_unshifted, window_shifted = tr.first_window_labels()
    return {"settings": {"sequences": tr.SEQUENCES, "epochs": tr.EPOCHS, "lr": tr.LR, "micro": 4, "steps": 4},
            "check": {"equivalent": good.equivalent, "rel": max(d.rel for d in good.diffs),
                      "unshifted_equivalent": bad.equivalent, "unshifted_rel": max(d.rel for d in bad.diffs)},
            "tokens": {"labels": unshifted, "shifted": shifted, "ratio": shifted / unshifted,
                       "smaller_step_percent": 100 * (1 - shifted / unshifted),
                       "recipe_batch_labels": window_unshifted, "recipe_batch_shifted": window_shifted},
            "run": {"diff": max_diff(recipe_run, full), "moved": max_diff(full, base),
                    "without_loss_type": max_diff(unchecked, full)}}


def rl_figures() -> dict[str, Any]:
    from gradaccum.integrations.rl import LOSS_TYPES
    from tests.integrations import test_rl as rl
    from tests.integrations.policy import rollouts
    from tests.reference import tiny_lm

    table = {}
    for loss_type in sorted(LOSS_TYPES, key=["grpo", "sapo", "dr_grpo", "luspo", "bnpo", "dapo", "cispo",
                                              "vespo"].index):
        batch = rollouts(8)
        reference = rl.full_batch(loss_type, batch, [(0, 8)])
        splits = {name: rl.diff(rl.recipe_run(loss_type, batch, [sizes], steps=len(sizes)), reference)
                  for name, sizes in rl.SPLITS.items()}
        trl = rl.diff(rl.trl_run(loss_type, batch, [3, 3, 2], steps=3, steps_per_generation=3), reference)
        batch16 = rollouts(16, seed=1)
        reference2 = rl.full_batch(loss_type, batch16, [(0, 8), (8, 16)])
        gen = rl.diff(rl.recipe_run(loss_type, batch16, [[4, 4, 4, 4]], steps=2), reference2)
        gen_trl = rl.diff(rl.trl_run(loss_type, batch16, [4, 4, 4, 4], steps=2, steps_per_generation=4),
                          reference2)
        table[loss_type] = {"moved": rl.diff(reference, tiny_lm()), "splits": splits,
                            "gradaccum_worst": max(splits.values()), "trl_3_3_2": trl,
                            "generation_gradaccum": gen, "generation_trl": gen_trl}
    mask = rollouts(16, seed=1)["mask"]
    tokens = [int(mask[:8].sum()), int(mask[8:].sum())]
    total = sum(tokens)
    return {"loss_types": table, "generation": {
        "completions": 16, "micro": 4, "window": 2, "tokens": total, "windows": tokens,
        "trl_scale": [total / 2 / t for t in tokens]}}


def terms_figures() -> dict[str, Any]:
    from tests.torch import test_terms as tt

    out: dict[str, Any] = {"splits": {}}
    for name, sizes in tt.SPLITS.items():
        data = tt.batch()
        ref, exact, naive = tt.fresh(), tt.fresh(), tt.fresh()
        tt.reference(ref, data, sizes)
        tt.train_terms(exact, data, sizes)
        tt.train_naive(naive, data, sizes)
        out["splits"][name] = {"gradaccum": float((tt.params_of(exact) - tt.params_of(ref)).abs().max()),
                               "naive": float((tt.params_of(naive) - tt.params_of(ref)).abs().max()),
                               "moved": float((tt.params_of(ref) - tt.params_of(tt.fresh())).abs().max())}
    splits = out["splits"].values()
    out |= {"tokens": int(tt.batch()[3].sum()), "sequences": int(tt.batch()[3].shape[0]), "actions": 3,
            "lr": 0.5,
            "moved": max(s["moved"] for s in splits),
            "gradaccum": {"min": min(s["gradaccum"] for s in splits),
                          "max": max(s["gradaccum"] for s in splits)},
            "naive": {"min": min(s["naive"] for s in splits), "max": max(s["naive"] for s in splits)}}
    return out


def language_model_figures() -> dict[str, Any]:
    """docs/LANGUAGE_MODELS.md's recipes: Hugging Face (GPT-2, Llama), its mistakes, nanoGPT."""
    from tests.torch import test_language_models as lm

    out: dict[str, Any] = {"settings": {"sequences": 32, "epochs": 2, "micro": 4, "steps": 4,
                                        "full_batch": 16, "optimizer_steps": 4}}
    for kind in ("gpt2", "llama"):
        base = lm.hf_model(kind)
        full = lm.hf_train(base, 16, 1)
        out[kind] = {"diff": lm.max_diff(lm.hf_train(base, 4, 4), full), "moved": lm.max_diff(full, base)}
    base = lm.hf_model("gpt2")
    full = lm.hf_train(base, 16, 1)
    mistakes = {"no_shift": (", shift=True", ""),
                "naive": (', n_items=gradaccum.count_tokens(batch["labels"], shift=True)', ""),
                "schedule_in_micro_batches": ("windows = math.ceil(len(loader) / steps)",
                                              "windows = len(loader)")}
    out["gpt2_mistakes"] = {name: lm.max_diff(lm.hf_train(base, 4, 4, edit), full)
                            for name, edit in mistakes.items()}
    base32 = lm.hf_model("gpt2").float()
    out["gpt2_float32"] = lm.max_diff(lm.hf_train(base32, 4, 4), lm.hf_train(base32, 16, 1))
    gpt = lm.tiny_gpt(ignore_index=-1)
    nano_full = lm.nanogpt_train("nanogpt-original", gpt, 16, 1)
    out["nanogpt"] = {"port": lm.max_diff(lm.nanogpt_train("nanogpt", gpt, 4, 4), nano_full),
                      "own_loop": lm.max_diff(lm.nanogpt_train("nanogpt-original", gpt, 4, 4), nano_full),
                      "moved": lm.max_diff(nano_full, gpt)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import accelerate
    import transformers

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"machine": {**describe_machine(), "accelerate": accelerate.__version__,
                              "transformers": transformers.__version__},
                  "accelerate": accelerate_figures(Path(tmp)), "trainer": trainer_figures(Path(tmp)),
                  "rl": rl_figures(), "terms": terms_figures(),
                  "language_models": language_model_figures()}
    result["benchmark_seconds"] = time.perf_counter() - start
    write_results(args.json, result)
    print(f"wrote {args.json} in {result['benchmark_seconds']:.0f} s")


if __name__ == "__main__":
    main()
