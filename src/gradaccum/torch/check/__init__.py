"""Is accumulation exact for this model? The equivalence checker, its losses (item-weighted ones
included), its report, module hazards and the module tracing behind them (docs/CHECK.md).

It may import the core, ``accumulator.py`` (it trains through the public API) and ``tokens.py``."""
