"""A verifiers 0.4.0 taskset written against its public API, as a user's
would be (``vf-init`` layout: one module exporting one Taskset): three sums
to work out with an ``add`` tool, rewarded by the final answer."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["CalcTaskset"]

ROWS = [("What is 2+3? Use the tool, then reply with the number.", "5"),
        ("What is 10+32? Use the tool, then reply with the number.", "42"),
        ("What is 7+8? Use the tool, then reply with the number.", "15")]


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    strict: bool = True  # the reply must be the number alone, else contain it


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = (trace.last_reply or "").strip()
        if self.config.strict:
            return float(reply == self.data.answer)
        return float(self.data.answer in reply.split())

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()
    repeats: int = 1  # each sum this many times, as tasks of their own


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for repeat in range(self.config.repeats):
            for number, (question, answer) in enumerate(ROWS):
                task_id = f"sum-{number}" + (f"-{repeat}" if repeat else "")
                yield CalcTask(CalcData(id=task_id, prompt=question, answer=answer,
                                        system_prompt="You are a calculator agent."),
                               self.config.task)
