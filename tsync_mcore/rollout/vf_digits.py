"""A tiny verifiers environment, written with verifiers' own classes as a `prime env`
package is, for `rollout.env: verifiers:tsync_mcore.rollout.vf_digits`
(configs/verifiers_tiny.yaml, tests/integration/test_verifiers_live.py).

The task: write a number in digits. Multi-turn (vf.MultiTurnEnv): an answer without the
number gets feedback and another try, up to `max_turns`. The rubric (vf.Rubric) scores the
last answer: `correct` (it contains the number: 1, else 0) plus 0.5 × `no_letters` (the
share of its non-space characters that are not letters: "digits only"), so even a tiny
random model's answers differ in reward within a group. The dataset is made here (no network): rows with
`question` and `answer`, which verifiers turns into chat prompts with the system prompt.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Answer with the number in digits only."
TRAIN = [314, 271, 141, 173, 662, 577, 112, 908]
EVAL = [42, 7, 1000]


def _rows(numbers: list[int]) -> Dataset:
    return Dataset.from_list([{"question": f"Write the number {n} in digits.", "answer": str(n)}
                              for n in numbers])


def last_answer(completion: vf.Messages) -> str:
    """The text of the last assistant message ("" if none)."""
    texts = [m["content"] if isinstance(m, dict) else m.content
             for m in completion if (m["role"] if isinstance(m, dict) else m.role) == "assistant"]
    return str(texts[-1] or "") if texts else ""


def correct(completion: vf.Messages, answer: str) -> float:
    return 1.0 if answer in last_answer(completion) else 0.0


def no_letters(completion: vf.Messages) -> float:
    chars = [c for c in last_answer(completion) if not c.isspace()]
    return sum(not c.isalpha() for c in chars) / len(chars) if chars else 0.0


class DigitsEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State,
                           **kwargs) -> vf.Messages:
        answer = state["answer"]
        if correct(messages, answer):
            state["final_env_response"] = [{"role": "user", "content": "Correct."}]
            return state["final_env_response"]
        return [{"role": "user", "content": f"Not yet: the number has {len(answer)} digits. "
                                            f"Try again."}]


def load_environment(max_turns: int = 2, **kwargs) -> vf.Environment:
    rubric = vf.Rubric(funcs=[correct, no_letters], weights=[1.0, 0.5])
    return DigitsEnv(dataset=_rows(TRAIN), eval_dataset=_rows(EVAL),
                     system_prompt=SYSTEM_PROMPT, rubric=rubric, max_turns=max_turns, **kwargs)
