"""Tasks: problems with reference answers and a reward function.

``load_task(spec, *, seed=0, **options)`` builds a :class:`Task` from a spec:

* ``tiny:repeat``, ``tiny:add`` - tiny built-in tasks for tests and quick runs,
* ``math500``, ``gsm8k`` - benchmark files in the shared data directory,
* ``rg:NAME`` - a reasoning-gym dataset,
* ``jsonl:PATH``, ``parquet:PATH`` - your own problems file,
* ``aime:PATH``, ``mcq:PATH``, ``gpqa:PATH``, ``humaneval``, ``humaneval:PATH`` - benchmark formats
  (integer answers, shuffled multiple choice, sandboxed code; see :mod:`meshrl.tasks.formats`).

Options go as keyword arguments or in the spec: ``jsonl:data.jsonl?problem=question&answer=ans``.
"""

from meshrl.tasks import files, formats, rg, tiny  # noqa: F401  (registers the built-in tasks)
from meshrl.tasks._spec import split_spec
from meshrl.tasks.base import (
    BOXED_INSTRUCTION,
    DEFAULT_INSTRUCTIONS,
    LAST_NUMBER_INSTRUCTION,
    REWARD_KINDS,
    Problem,
    StaticTask,
    Task,
    list_tasks,
    load_task,
    register_spec_loader,
    register_task,
    register_task_prefix,
    with_kind,
)
from meshrl.tasks.files import FileTask, data_dir, load_file_task
from meshrl.tasks.formats import CodeTask, build_program, load_aime, load_humaneval, load_mcq, option_permutation
from meshrl.tasks.rg import ReasoningGymTask
from meshrl.tasks.tiny import AddTask, RepeatTask

__all__ = [
    "BOXED_INSTRUCTION",
    "DEFAULT_INSTRUCTIONS",
    "LAST_NUMBER_INSTRUCTION",
    "REWARD_KINDS",
    "AddTask",
    "CodeTask",
    "FileTask",
    "Problem",
    "ReasoningGymTask",
    "RepeatTask",
    "StaticTask",
    "Task",
    "build_program",
    "data_dir",
    "list_tasks",
    "load_aime",
    "load_file_task",
    "load_humaneval",
    "load_mcq",
    "load_task",
    "option_permutation",
    "register_spec_loader",
    "register_task",
    "register_task_prefix",
    "split_spec",
    "with_kind",
]
