"""Layer 1: what a run writes for its user: metrics.jsonl and the sample files (one writer), plots,
and the trackers beside them (TensorBoard, wandb, trackio, MLflow)."""
