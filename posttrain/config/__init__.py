"""Layer 2: the typed, validated configs: the algorithm presets, one frozen dataclass per section,
the commands' configs on one base of common options, and their command-line / YAML layer."""
