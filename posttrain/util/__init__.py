"""Layer 0, plain Python (no torch): the registries, errors and value checks, failure tallies,
loading a user's `module:function`, the allocator's tuning."""
