"""Data plane: task adapters own prompts, ground truth and reward (ground truth never leaves the learner)."""

from echo2swarm.tasks.arith import ArithTask
from echo2swarm.tasks.base import Prompt, SupervisedTask, Task
from echo2swarm.tasks.math import MathTask
from echo2swarm.tasks.poker import PokerTask
from echo2swarm.tasks.registry import available_tasks, get_task

__all__ = ["ArithTask", "MathTask", "PokerTask", "Prompt", "SupervisedTask", "Task", "available_tasks", "get_task"]
