from kuhn_poker.taskset import KuhnPokerEnv, KuhnPokerTaskset

__all__ = ["KuhnPokerEnv", "KuhnPokerTaskset"]
