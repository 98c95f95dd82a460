"""Layer 3: the model on its devices: loading and saving Hugging Face models (the embedded one,
LoRA), prompts through the chat template, the torchrun world (DDP / FSDP2), the memory estimate."""
