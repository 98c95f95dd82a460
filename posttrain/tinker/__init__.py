"""Layer 9: `posttrain tinker-serve`, Tinker's training and sampling API served
on your own machine, so code written for the `tinker` SDK (tinker-cookbook's recipes) trains here
unchanged (docs/tinker.md).

    wire.py      the SDK's protobuf messages <-> tensors (its generated module, not a copy)
    losses.py    Tinker's built-in losses, each one of posttrain's formulas, summed over tokens
    models.py    the base model, one LoRA adapter per training client, samplers, checkpoints
    futures.py   every request a future; retrieve long-polls; one worker runs them in order
    server.py    the routes the SDK calls
"""
