"""Layer 3: prompts with checkable answers: built-in generated tasks and user files."""

from posttrain.data.files import load_problems, read_rows
from posttrain.data.tasks import TASKS, Problem, Task, make_task

__all__ = ["TASKS", "Problem", "Task", "load_problems", "make_task", "read_rows"]
