"""A verifiers environment of two seats for tests/test_verifiers_envs.py: the `solver` seat
answers its task twice in one episode (as a proposer's several solvers do) and a `critic` seat,
untrainable as a user simulator is, answers once."""

import verifiers.v1 as vf


class EchoTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def said_ok(self, trace: vf.Trace) -> float:
        return float("ok" in (trace.last_reply or ""))


class SeatsConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class SeatsEnv(vf.Env[SeatsConfig]):
    async def setup(self, agents):
        agents.critic.trainable = False

    async def run(self, task, agents):
        await agents.solver.run(task)
        await agents.solver.run(task)
        await agents.critic.run(task)


class SeatsTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for a in range(3):
            yield EchoTask(vf.TaskData(prompt=f"Say ok {a}."), self.config.task)


__all__ = ["EchoTask", "SeatsEnv", "SeatsTaskset"]
