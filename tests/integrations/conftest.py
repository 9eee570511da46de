"""Accelerate keeps its state process-wide: every test here starts and ends without it."""

import importlib.util

import pytest


def _reset() -> None:
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def no_accelerator_state():
    _reset()
    yield
    _reset()
