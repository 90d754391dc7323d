"""reasoning-gym tasks as prompt rows, for `rollout.env: reasoning_gym:<task>`.

reasoning-gym generates each entry of a task from a seed: entry i of a set made with seed
s is drawn from `Random(s + i)`, so a set is a pure function of (task, params, seed, size).
Both sets are generated at start, in memory, as the Rows a PromptSet gives: the question as
the (string) prompt, the answer as the label, the entry's other fields (`metadata`) as
meta. Rendering, the epoch sampler, data positions and resume are then the dataset env's.
Every problem is one line naming its config key.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from tsync_mcore.data.load import DataError, Row, check_prompt

ENTRY_KEYS = ("question", "answer")  # the rest of an entry is the row's meta


class TaskSet:
    """A generated set with PromptSet's interface (`path`, `len`, `row(i)`), and the
    reasoning-gym dataset whose `score_answer` scores its answers."""

    def __init__(self, path: str, dataset: Any, entries: list[dict[str, Any]]) -> None:
        self.path, self.dataset, self.entries = path, dataset, entries
        self.left_out = 0  # evaluation: questions dropped because training has them

    def __len__(self) -> int:
        return len(self.entries)

    def row(self, i: int) -> Row:
        e = self.entries[int(i)]
        return Row(index=int(i), prompt=e["question"], label=e["answer"],
                   meta={k: v for k, v in e.items() if k not in ENTRY_KEYS})


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def registry(where: str) -> dict[str, tuple[type, type]]:
    """reasoning-gym's task name → (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        if e.name and e.name.split(".")[0] == "reasoning_gym":
            raise DataError(f"{where}: the reasoning-gym package is not installed (pip install "
                            f"reasoning-gym==0.1.25, as requirements.txt pins)") from None
        raise DataError(f"{where}: importing reasoning_gym failed: {_first_line(e)}") from None
    return DATASETS


def task_classes(task: str) -> tuple[type, type]:
    where = f"config key 'rollout.env' (reasoning_gym:{task})"
    tasks = registry(where)
    if task not in tasks:
        close = difflib.get_close_matches(task, tasks, n=5, cutoff=0.5)
        hint = (f"close names: {', '.join(close)}" if close else
                f"{len(tasks)} tasks, e.g. {', '.join(sorted(tasks)[:5])}")
        raise DataError(f"{where}: reasoning-gym has no task {task!r} ({hint})")
    return tasks[task]


def make_dataset(task: str, params: dict[str, Any], seed: int, size: int) -> Any:
    """reasoning_gym.create_dataset(task, seed=, size=, **params), its errors reworded."""
    dataset_cls, config_cls = task_classes(task)
    key = "config key 'reasoning_gym.params'"
    names = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise DataError(f"{key}: task {task} has no parameter {', '.join(map(repr, unknown))} "
                        f"(its parameters: {', '.join(names)})")
    try:
        config = config_cls(seed=seed, size=size, **params)
        if hasattr(config, "validate"):
            config.validate()
        return dataset_cls(config=config)
    except Exception as e:  # the task's own checks: mostly bare asserts
        raise DataError(f"{key}: task {task} refused {params}: {_first_line(e)}") from None


def generate(task: str, params: dict[str, Any], seed: int, size: int, split: str) -> TaskSet:
    dataset = make_dataset(task, params, seed, size)
    path = f"reasoning_gym:{task} {split} set (seed {seed})"
    entries = []
    for i in range(size):
        try:
            entry = dataset[i]
        except Exception as e:
            raise DataError(f"{path} entry {i}: reasoning-gym raised {_first_line(e)}") from None
        if not isinstance(entry, dict) or "question" not in entry or "answer" not in entry:
            raise DataError(f"{path} entry {i}: not a mapping with 'question' and 'answer'")
        why = check_prompt(entry["question"])
        if why or not isinstance(entry["question"], str):
            raise DataError(f"{path} entry {i}: question: {why or 'not a string'}")
        entries.append(entry)
    return TaskSet(path, dataset, entries)


def task_sets(task: str, params: dict[str, Any], *, train_seed: int, train_size: int,
              eval_seed: int, eval_size: int) -> tuple[TaskSet, TaskSet | None]:
    """The training set and (eval_size > 0) the evaluation set. Disjoint seed ranges
    (checked with the config) can still draw the same question from a small task space:
    evaluation leaves those out (counted in `left_out`), so it never scores a question
    training has seen."""
    train = generate(task, params, train_seed, train_size, "train")
    if not eval_size:
        return train, None
    full = generate(task, params, eval_seed, eval_size, "eval")
    seen = {e["question"] for e in train.entries}
    ev = TaskSet(full.path, full.dataset, [e for e in full.entries if e["question"] not in seen])
    ev.left_out = len(full) - len(ev)
    if not ev.entries:
        raise DataError(f"config key 'reasoning_gym.eval_size': all {eval_size} questions of "
                        f"{full.path} are also in the training set (the task's parameters "
                        f"allow too few distinct questions)")
    return train, ev
