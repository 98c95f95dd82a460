"""Layer 8: the RL learner and loop (docs/algorithms.md §2-§8): the policy's learner (learner.py:
the models, optimizer and checkpoint), its stages (frozen.py, advantage.py, loss_terms.py,
update.py), teachers and the value model, what a step logs, and `train` itself (job.py builds the
learner and the Sampling service, loop.py is the lecture's loop)."""
