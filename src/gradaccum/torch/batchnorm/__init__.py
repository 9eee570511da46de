"""BatchNorm under accumulation: conversions (GroupNorm and back), momentum rules, and window
BatchNorm, whose running statistics are those of the whole window (docs/BATCHNORM.md).

It may import the core and ``accumulator.py`` (window BatchNorm registers the Accumulator's
public hooks)."""
