"""BatchNorm under accumulation: conversions (GroupNorm and back), momentum rules, and window
BatchNorm, whose running statistics are those of the whole window (docs/BATCHNORM.md)."""
