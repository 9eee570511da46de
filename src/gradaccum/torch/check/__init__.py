"""Is accumulation exact for this model? The equivalence checker, its report, module hazards and
the module tracing behind them (docs/CHECK.md)."""
