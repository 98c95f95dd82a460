"""A single-turn verifiers taskset for tests/test_verifiers.py: add two numbers; the rubric
rewards the right sum (weight 1) and a short reply (weight 0.1)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") < 8)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(1, 7):
            yield SumTask(SumData(prompt=f"What is {a} + {a + 1}?", answer=str(2 * a + 1)),
                          self.config.task)


__all__ = ["SumTask", "SumTaskset"]
