"""Dataset files → validated prompt rows.

Formats (by path): a `.jsonl`/`.json` file (one JSON object per line), a `.parquet`
file, or a directory written by `datasets.Dataset.save_to_disk`. All are read with the
`datasets` library (Arrow, memory-mapped), so large sets do not sit in Python objects.
Everything is checked at start, before the engine or the channel is up: the file, its
columns, and every row's prompt and label. A problem is one line, `DataError`, naming the
file, the row (0-based, in file order; JSONL also names the line) and the column.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.util.safe_files import BadFile, regular_file

ROLES = ("system", "user", "assistant", "tool")


class DataError(BadFile):
    """A dataset file or row is unusable; the message names the file, row and column."""


@dataclass(frozen=True)
class Row:
    index: int  # row number in the file (0-based)
    prompt: str | list[dict[str, str]]  # text, or chat messages [{"role", "content"}, ...]
    label: Any  # ground truth for the reward (None when data.label_key is "")
    meta: dict[str, Any] = field(default_factory=dict)  # every other column, as stored


def _format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            example = os.path.join(path, splits[0] if splits else "train")
            raise DataError(f"{path}: a DatasetDict with splits {splits}; point the key at one "
                            f"split's directory, e.g. {example}")
        if not os.path.exists(os.path.join(path, "dataset_info.json")):
            raise DataError(f"{path}: a directory, but not one written by datasets' "
                            f"save_to_disk (no dataset_info.json)")
        return "disk"
    name = path.lower()
    if name.endswith((".jsonl", ".json")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise DataError(f"{path}: unknown data format (expected .jsonl, .json, .parquet, or a "
                    f"directory written by datasets' save_to_disk)")


def _check_jsonl(path: str, label_parts: list[str]) -> list[Any] | None:
    """Every line one JSON object: the datasets reader would name neither line nor cause.
    Returns each row's label as the file has it (Arrow unifies a column's types: a "4" among
    numbers would become 4), or None without a label key."""
    labels: list[Any] | None = [] if label_parts else None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    rows = 0
    with f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{n}: each line must be a JSON object, got "
                                    f"{type(obj).__name__}")
                where = _surrogate_at(obj)
                if where:
                    raise DataError(f"{path}:{n}: row {rows}: {where} holds a lone UTF-16 "
                                    f"surrogate (a \\ud800-\\udfff escape without its pair): "
                                    f"not text")
                if labels is not None:
                    labels.append(_dig(obj, label_parts)[1])
                rows += 1
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None
    if not rows:
        raise DataError(f"{path}: empty file (no rows)")
    return labels


def _surrogate_at(value: Any, where: str = "") -> str | None:
    """Where in a JSON value a string (or key) holds a lone surrogate: JSON's \\uXXXX
    escapes allow one, Python keeps it, and Arrow refuses the whole file without naming it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "the row"
        return None
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        name = f"{where}[{k}]" if isinstance(k, int) else \
            f"{where}.{k}" if where else f"column {k!r}"
        if isinstance(k, str) and _surrogate_at(k):
            return f"a key in {where or 'the row'}"
        found = _surrogate_at(v, name)
        if found:
            return found
    return None


def _blank(path: str) -> bool:
    """Whether the file holds nothing but whitespace (datasets' JSON reader ends in a bare
    StopIteration there)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _read(path: str, label_parts: list[str]):
    """(the dataset, the labels as a JSONL file has them or None)."""
    import datasets

    datasets.disable_progress_bars()
    fmt = _format(path)
    if fmt != "disk":
        try:
            regular_file(path, follow_symlinks=True)  # a FIFO or device would block the reader
        except BadFile as e:
            raise DataError(str(e)) from None
    labels = None
    # datasets logs a reader's failure itself before raising it: the DataError says it once
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL
    try:
        if fmt == "disk":
            ds = datasets.load_from_disk(path, keep_in_memory=False)
        else:
            if fmt == "json" and path.lower().endswith(".jsonl"):
                labels = _check_jsonl(path, label_parts)
            elif _blank(path):
                raise DataError(f"{path}: empty file (no rows)")
            ds = datasets.load_dataset(fmt, data_files=path, split="train")
    except DataError:
        raise
    except Exception as e:  # Arrow/parquet/json decoding: one line, not a traceback
        while e.__cause__ is not None:  # the reader's own error names the row; the
            e = e.__cause__  # DatasetGenerationError datasets raises from it does not
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if "corresponds to no data" in first:  # datasets' words for a file of no rows ([])
            raise DataError(f"{path}: no rows") from None
        raise DataError(f"{path}: cannot read as {fmt} ({type(e).__name__}: {first})") from None
    finally:
        log.setLevel(level)
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path}: holds {type(ds).__name__}, expected one dataset split")
    if labels is not None and len(labels) != len(ds):
        labels = None  # (blank lines aside, rows are lines; otherwise Arrow's values)
    return ds, labels


def _dig(value: Any, parts: list[str]) -> tuple[bool, Any]:
    for p in parts:
        if not isinstance(value, dict) or p not in value:
            return False, None
        value = value[p]
    return True, value


def check_prompt(prompt: Any) -> str | None:
    """Why `prompt` is not a usable prompt (text or chat messages), or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty prompt"
    if not isinstance(prompt, list):
        return f"must be a string or a list of chat messages, got {type(prompt).__name__}"
    if not prompt:
        return "empty messages list"
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"message {j} is {type(m).__name__}, not a {{role, content}} mapping"
        if m.get("role") not in ROLES:
            return f"message {j} has role {m.get('role')!r} (expected one of {list(ROLES)})"
        if not isinstance(m.get("content"), str):
            return f"message {j} has no 'content' string"
    return None


class PromptSet:
    """A loaded, checked dataset: `len(ps)` rows, `ps.row(i)` one of them."""

    def __init__(self, path: str, prompt_key: str = "prompt", label_key: str = "",
                 require_label: bool = True) -> None:
        if not path:
            raise DataError("no dataset path given")
        if not os.path.exists(path):
            raise DataError(f"{path}: no such file or directory")
        self.path = path
        self.prompt_key = prompt_key
        self.label_parts = label_key.split(".") if label_key else []
        self.ds, self.labels = _read(path, self.label_parts)
        cols = list(self.ds.column_names)
        if len(self.ds) == 0:
            raise DataError(f"{path}: the dataset has no rows")
        if prompt_key not in cols:
            raise DataError(f"{path}: no column {prompt_key!r} for the prompt (columns: "
                            f"{cols}); set data.prompt_key")
        self.label_key = label_key
        if self.label_parts and self.label_parts[0] not in cols:
            if require_label:
                raise DataError(f"{path}: no column {self.label_parts[0]!r} for the label "
                                f"(columns: {cols}); set data.label_key ('' for none)")
            self.label_parts = []
        # The label's own column is not repeated in meta; a dotted label's column is (it
        # holds more than the label, e.g. SkyRL's reward_spec).
        self.meta_cols = [c for c in cols if c != prompt_key
                          and not (len(self.label_parts) == 1 and c == self.label_parts[0])]
        self._check_rows()

    def _check_rows(self) -> None:
        cols = list(dict.fromkeys([self.prompt_key] + self.label_parts[:1]))
        i = 0
        for batch in self.ds.select_columns(cols).iter(batch_size=1024):  # columns of lists
            for j, prompt in enumerate(batch[self.prompt_key]):
                why = check_prompt(prompt)
                if why:
                    raise DataError(f"{self.path} row {i + j}: column {self.prompt_key!r}: {why}")
            if self.label_parts:
                for j, top in enumerate(batch[self.label_parts[0]]):
                    found, value = _dig({self.label_parts[0]: top}, self.label_parts)
                    if not found or value is None:
                        raise DataError(f"{self.path} row {i + j}: no label at "
                                        f"{self.label_key!r}")
            i += len(batch[self.prompt_key])

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> Row:
        ex = self.ds[int(i)]
        prompt = ex[self.prompt_key]
        if isinstance(prompt, list):  # Arrow unifies message structs: drop absent fields
            prompt = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        label = (None if not self.label_parts else self.labels[int(i)]
                 if self.labels is not None else _dig(ex, self.label_parts)[1])
        return Row(index=int(i), prompt=prompt, label=label,
                   meta={c: ex[c] for c in self.meta_cols})


def load_prompts(path: str, data_cfg, *, require_label: bool = True) -> PromptSet:
    """data.train / data.eval → a PromptSet, with the config's column names."""
    return PromptSet(path, data_cfg.prompt_key, data_cfg.label_key, require_label=require_label)
