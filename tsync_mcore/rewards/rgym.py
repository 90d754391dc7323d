"""The reasoning-gym task's own scorer as a reward function (rollout.env: reasoning_gym:<task>).

The answer handed to `score_answer` is the text of the completion's last
`<answer_tag>...</answer_tag>` pair, stripped (reasoning-gym's own `extract_answer`, its
convention for every task); a completion without one gives None, which the tasks score 0.
`answer_tag: ""` hands over the whole completion, stripped; `answer_from: last_number` its
last number (a sign and decimals kept), or None. The call runs under the
reward.* rules of any reward function (RewardRunner: timeout_s, on_error), in a jailed
worker by default (rewards/jailed.py: several tasks `eval` the answer).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any


LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(response: str, tag: str, answer_from: str = "tag") -> str | None:
    if answer_from == "last_number":
        numbers = LAST_NUMBER.findall(response)
        return numbers[-1] if numbers else None
    if not tag:
        return response.strip()
    from reasoning_gym.utils import extract_answer as last_tagged

    return last_tagged(response, tag_name=tag)


MAX_LITERAL = 1 << 16  # characters of an answer read as a Python literal


def literal(text: Any, *_: Any) -> Any:
    """What a task's `eval(answer)` gets instead: the answer read as a Python literal (a
    list, a string, numbers), never run; anything else raises, which the tasks score 0."""
    if not isinstance(text, str) or len(text) > MAX_LITERAL:
        raise ValueError("not a literal answer")
    return ast.literal_eval(text)


def answers_as_data(dataset: Any) -> None:
    """Tasks whose `score_answer` calls `eval` on the model's answer (spiral_matrix,
    string_insertion, binary_matrix, n_queens: to read a list) get `literal` for that name
    in their module: every answer they reward is a literal, and a payload is not run even
    in the jailed worker (where it could still forge its own trajectory's score)."""
    fn = getattr(type(dataset), "score_answer", None)
    try:
        uses_eval = fn is not None and re.search(r"(?<![\w.])eval\(", inspect.getsource(fn))
    except (OSError, TypeError):
        uses_eval = False
    if uses_eval:
        module = sys.modules[fn.__module__]
        module.eval = literal  # module globals come before builtins in name lookup


def task_reward(dataset: Any, answer_tag: str, answer_from: str = "tag") -> Callable[..., Any]:
    """A reward function over the rows of tsync_mcore.data.rgym: the entry the scorer sees
    is rebuilt from the row (question = prompt, answer = label, the rest = meta)."""
    answers_as_data(dataset)

    def score(*, prompt: Any, response: str, label: Any, meta: dict[str, Any],
              **_: Any) -> Any:
        entry = {"question": prompt, "answer": label, **meta}
        return dataset.score_answer(answer=extract_answer(response, answer_tag, answer_from),
                                    entry=entry)

    return score
