"""Layer 4: the run viewer (`posttrain view`, docs/viewer.md): curves of several runs overlaid, the
rollouts of each step token by token, the held-out answers of each evaluation (server.py)."""
