"""The epoch loop every backend's trainer shares: train, evaluate, print, record."""

from __future__ import annotations

import time
from collections.abc import Callable

from gradaccum.demos.config import EpochResult, RunResult, TrainConfig
from gradaccum.demos.metrics import MetricsWriter

__all__ = ["run_epochs"]


def run_epochs(
    config: TrainConfig,
    log: Callable[[str], None],
    writer: MetricsWriter,
    *,
    train_epoch: Callable[[int], tuple[list[float], float]],
    evaluate: Callable[[], tuple[float, float]],
    counters: Callable[[], tuple[int, int]],
    peak_memory: Callable[[], int],
    train_items: int,
    result: RunResult | None = None,
) -> RunResult:
    """Run ``config.epochs`` epochs with the seed's lines, one :class:`EpochResult` each.

    Args:
        config: the settings.
        log: where the lines go.
        writer: records each epoch (closed at the end, also on an error).
        train_epoch: ``epoch -> (window losses, seconds)``: one pass over the training set.
        evaluate: ``() -> (test accuracy in percent, mean test loss)``.
        counters: ``() -> (optimizer steps, skipped windows)`` so far.
        peak_memory: ``() -> bytes``.
        train_items: items in one epoch (for samples/s).
        result: a resumed run's results so far (its finished epochs and seconds): the loop
            continues with the next epoch, and ``train_epoch`` with its position in it.

    Returns:
        The run's results (without the final parameters, which the backend adds).
    """
    result = RunResult(config) if result is None else result
    start = time.perf_counter()
    try:
        for epoch in range(len(result.epochs) + 1, config.epochs + 1):
            log(f"Epoch {epoch}\n-------------------------------")
            window_losses, seconds = train_epoch(epoch)
            accuracy, test_loss = evaluate()
            log(f"Test: Accuracy: {accuracy:>0.1f}%, Avg loss: {test_loss:>8f}\n")
            steps, skipped = counters()
            epoch_result = EpochResult(
                epoch=epoch, test_accuracy=accuracy, test_loss=test_loss,
                train_loss=sum(window_losses) / max(len(window_losses), 1),
                optimizer_steps=steps, seconds=seconds, samples_per_s=train_items / seconds,
                peak_memory_bytes=peak_memory(), skipped_windows=skipped)
            result.epochs.append(epoch_result)
            writer.epoch(epoch_result)
    finally:
        writer.close()
    result.seconds += time.perf_counter() - start
    return result
