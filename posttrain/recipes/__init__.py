"""Layer 0: the packaged recipes (YAML configs; `posttrain train --config`, options.recipe_path)."""
