"""A multi-turn verifiers taskset with a tool for tests/test_verifiers.py: multiply with a
calculator (an MCP toolset, started by verifiers per rollout as `python -m tests.vf_calc`)."""

import verifiers.v1 as vf


class CalcConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalcConfig, vf.State]):
    TOOL_PREFIX = None

    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(int(a) * int(b))


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(CalcConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(12, 34), (23, 45), (31, 17), (41, 29), (52, 13)]:
            yield CalcTask(CalcData(prompt=f"What is {a} * {b}? Use the multiply tool.",
                                    answer=str(a * b)), self.config.task)


__all__ = ["CalcTask", "CalcTaskset", "Calculator"]

if __name__ == "__main__":
    Calculator.run()
