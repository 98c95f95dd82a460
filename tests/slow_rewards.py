"""A reward function that takes its time, for tests that signal a run in the middle of a step
(tests/test_vllm_signals.py): scoring then fills most of each step, after the batch is sampled
and before the update and the weight push need the engine again."""

import time

from tests.toy_rewards import first_letter_a_to_e


def slow_first_letter(prompt: str, completion: str, answer: str) -> float:
    time.sleep(0.25)
    return first_letter_a_to_e(prompt, completion, answer)
