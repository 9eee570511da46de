"""Where users already train: Hugging Face Accelerate and RL policy losses (docs/INTEGRATIONS.md).

Each module is imported on its own (``import gradaccum.integrations.accelerate``); none is loaded
by ``import gradaccum``, and none needs its framework installed until it is used.
"""
