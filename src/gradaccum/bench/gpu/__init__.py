"""The GPU check: every CUDA claim of gradaccum measured by one command (``scripts/gpu_check.sh``).

Modules: ``run`` (the command: runs each check in a process of its own, time-boxed, and writes
the report), ``child`` (one check's process), ``check`` (what the checks share), ``report`` (the
table), ``gpt`` (the model most checks train), then one module per check: ``overhead``,
``host_sync``, ``fp16_scaler``, ``oom``, ``planner``, ``accum_dtype``, ``compiled``, ``ddp`` (with
its rank side, ``ddp_rank``). Without CUDA every check runs its smoke on the CPU. Nothing is
imported here, so that ``python -m gradaccum.bench.gpu.child`` starts clean. See docs/BENCHMARKS.md
("GPU").

May import: gradaccum.core, gradaccum.torch, gradaccum.demos
"""
