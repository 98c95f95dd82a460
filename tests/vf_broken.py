"""A verifiers taskset whose rubric raises on every rollout (tests/test_verifiers.py)."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        raise RuntimeError("the rubric is broken")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for a in range(6):
            yield BrokenTask(vf.TaskData(prompt=f"Say {a}."), self.config.task)


__all__ = ["BrokenTask", "BrokenTaskset"]
