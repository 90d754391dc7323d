"""What the judge reads and what it writes: the fenced prompt, and the parser of its verdict.

The answer is the policy's text, so it may try to speak for the judge: a fake "Reference
answer:" section, an instruction, a "Score: 10" the judge then quotes. Two rules keep its
own text out of the verdict:

- **Fences.** Each field is put between tags carrying a nonce drawn per call
  (`<answer-{nonce}>` … `</answer-{nonce}>`, `question` for the prompt, `reference` for the
  label); any fence-like tag (`<answer-…>`, `</reference-…>`, any nonce) is first removed from
  the field, so no field can close its fence or open another, and the policy cannot guess the
  nonce of a call that has not happened.
- **Verdicts only from the judge's own words.** A match of the parser counts only outside
  what the judge quoted (a span between fence tags of any nonce, a closed ``` block, a `>`
  quote line); and a match whose text (case, width and whitespace aside) occurs in the
  answer makes the output unscorable — the trajectory's error — rather than being skipped
  for another: a judge that copies the answer's "Score: 10" gives it no verdict, and an
  answer that holds the judge's likely verdict ("Score: 2") cannot strike it out to leave
  a "Score: 10" the judge wrote about a perfect answer. Under `pick: only` (the default)
  the verdicts must agree, so one the answer talked the judge into writing beside its own
  fails the output too.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import unicodedata
from dataclasses import dataclass
from typing import Any

FIELDS = ("prompt", "response", "label")
FENCES = {"prompt": "question", "response": "answer", "label": "reference"}  # field → tag
NONCE_HEX = 12  # 48 bits per call; fence tags in a field are removed anyway
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TAGS = "|".join(FENCES.values())
# any fence tag, whatever its nonce (or none): removed from fields, masked in the output
# (bounded repeats: a "<" before 60,000 spaces is no quadratic search)
_FENCE_TAG = re.compile(rf"<[ \t]{{0,8}}(/?)[ \t]{{0,8}}({_TAGS})-[^<>\s]{{0,64}}[ \t]{{0,8}}>",
                        re.IGNORECASE)
_BLOCK_QUOTE = re.compile(r"^[ \t]*>.*$", re.MULTILINE)
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")  # ASCII; no exponent, nan, inf
MAX_NUMBER_CHARS = 32  # a score longer than this is no score (e.g. "9" × 5000)
MAX_OUTPUT_CHARS = 1 << 16  # parse() refuses more: max_tokens keeps real outputs far below
SHOWN_CHARS = 120  # of the judge's output, in an error line


class ParserConfigError(ValueError):
    """reward.judge's parser keys are wrong; `key` names the one."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(msg)
        self.key = key


class JudgeParseError(ValueError):
    """The judge's output gives no score; the message says why (one line)."""


# --- the prompt -------------------------------------------------------------------------------

def check_template(template: str) -> None:
    """ValueError unless `template` holds {response} and no placeholder but FIELDS'."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError("must be a non-empty string")
    names = set(_PLACEHOLDER.findall(template))
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown placeholder {{{unknown[0]}}} (known: "
                         f"{', '.join('{' + f + '}' for f in FIELDS)})")
    if "response" not in names:
        raise ValueError("must contain {response} (the answer the judge grades)")
    if _FENCE_TAG.search(template):
        raise ValueError(f"holds a fence tag ({_FENCE_TAG.search(template).group(0)!r}): "
                         f"the fields are fenced by the judge itself, with a nonce per call")


def as_text(value: Any) -> str:
    """A row's prompt or label as the judge reads it: a string as is, chat messages as
    `role: content` lines, None as "", anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def unfence(text: str) -> str:
    """`text` without any fence tag (any nonce): it can neither close its fence nor open one."""
    out = _FENCE_TAG.sub("", text)
    if _FENCE_TAG.search(out):  # "<ans<answer-x>wer-y>" left one: no "<" can start a tag
        out = _FENCE_TAG.sub("", out.replace("<", "‹"))
    return out


def fence(field: str, text: str, nonce: str) -> str:
    tag = f"{FENCES[field]}-{nonce}"
    return f"<{tag}>\n{unfence(text)}\n</{tag}>"


def fill(template: str, *, prompt: Any, response: str, label: Any, nonce: str) -> str:
    """The template with each placeholder replaced by its field, fenced with `nonce`, in one
    pass: text inserted for one placeholder is never searched again (an answer writing
    "{label}" cannot pull the label into the judge's prompt)."""
    values = {"prompt": as_text(prompt), "response": response, "label": as_text(label)}
    return _PLACEHOLDER.sub(lambda m: fence(m.group(1), values[m.group(1)], nonce), template)


# --- the parser -------------------------------------------------------------------------------

def shorten(text: str, n: int = SHOWN_CHARS) -> str:
    """repr of the first n characters (one line whatever it holds), and the length if cut."""
    return repr(text[:n]) + (f"…({len(text)} chars)" if len(text) > n else "")


def squash(text: str) -> str:
    """Text compared for copying: NFKC (full-width "１０" is "10"), case-folded, no whitespace."""
    return re.sub(r"\s+", "", unicodedata.normalize("NFKC", text).casefold())


def quoted_spans(text: str) -> list[tuple[int, int]]:
    """Spans of the judge's output that quote rather than judge: a fence tag (any nonce) to
    its closing tag, a ``` block, a `>` quote line. An unclosed fence or block is no span
    (only its tag): an answer ending in "```" cannot hide the judge's verdict after it."""
    spans: list[tuple[int, int]] = []
    pos = 0
    unclosed: set[str] = set()  # tags with no closing tag further on: not searched again
    while (m := _FENCE_TAG.search(text, pos)) is not None:
        name, close = m.group(2).lower(), None
        if not m.group(1) and name not in unclosed:  # a stray closing tag: only itself
            close = next((c for c in _FENCE_TAG.finditer(text, m.end())
                          if c.group(1) and c.group(2).lower() == name), None)
            if close is None:
                unclosed.add(name)
        end = close.end() if close is not None else m.end()
        spans.append((m.start(), end))
        pos = end
    ticks = [m.start() for m in re.finditer(r"```", text)]
    spans += [(a, b + 3) for a, b in zip(ticks[::2], ticks[1::2])]
    spans += [(m.start(), m.end()) for m in _BLOCK_QUOTE.finditer(text)]
    return spans


@dataclass(frozen=True)
class Parser:
    """Judge output → reward (see JudgeConfig's parser keys)."""

    kind: str  # "regex" | "choices"
    pattern: re.Pattern[str]
    pick: str = "only"
    score_min: float = 0.0
    score_max: float = 10.0
    normalize: bool = True
    choices: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_config(cls, jc: Any) -> "Parser":
        """From JudgeConfig; ParserConfigError names the key that is wrong."""
        if jc.parser == "regex":
            try:
                pat = re.compile(jc.pattern)
            except (re.error, TypeError) as e:
                raise ParserConfigError("pattern", f"not a regular expression: {e}") from None
            if pat.groups != 1:
                raise ParserConfigError("pattern", f"must have exactly one group (the "
                                        f"score), has {pat.groups}: {jc.pattern!r}")
            if not jc.score_min < jc.score_max:
                raise ParserConfigError("score_max", f"must be > score_min ({jc.score_min}), "
                                        f"got {jc.score_max}")
            return cls("regex", pat, jc.pick, float(jc.score_min), float(jc.score_max),
                       bool(jc.normalize))
        if not jc.choices:
            raise ParserConfigError("choices", "parser 'choices' needs a mapping of words to "
                                    "rewards, e.g. {correct: 1, incorrect: 0}")
        words: dict[str, float] = {}
        for word, value in jc.choices.items():
            if not re.fullmatch(r"\w+(?:[ -]\w+)*", word):
                raise ParserConfigError("choices", f"{word!r} is not a word (letters, digits, "
                                        f"_, single spaces or hyphens between them)")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ParserConfigError("choices", f"{word!r} maps to {value!r}, not a finite "
                                        f"number")
            if word.lower() in words:
                raise ParserConfigError("choices", f"{word!r} is listed twice (case is ignored)")
            words[word.lower()] = float(value)
        # longest first: "not correct" wins over "correct" where both match at one place
        alts = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        pat = re.compile(rf"(?<!\w)({alts})(?!\w)", re.IGNORECASE)
        return cls("choices", pat, jc.pick, choices=tuple(words.items()))

    def __call__(self, text: str, answer: str = "") -> float:
        """The reward the output gives; JudgeParseError says why there is none. `answer`:
        the graded answer, whose own text is no verdict (see the module's docstring)."""
        if len(text) > MAX_OUTPUT_CHARS:
            raise JudgeParseError(f"output of {len(text)} characters (at most "
                                  f"{MAX_OUTPUT_CHARS} are read)")
        spans = quoted_spans(text)
        every = list(self.pattern.finditer(text))
        own = [m for m in every if not any(a <= m.start() < b for a, b in spans)]
        if not own:
            what = ("no score found" if self.kind == "regex" else
                    f"none of the choices {[w for w, _ in self.choices]} found")
            if every:
                what += f" outside quotes ({len(every)} inside)"
            raise JudgeParseError(what)
        copied = squash(answer)
        texts = {squash(m.group(0)): m.group(0) for m in own} if copied else {}
        for t, raw in texts.items():  # never dropped for another verdict: the answer would choose
            if t and t in copied:
                raise JudgeParseError(f"verdict {raw[:40]!r} is the answer's own text")
        found = [m.group(1) for m in own]
        values = [self._value(g) for g in found]
        if self.pick == "only" and len(set(values)) > 1:
            raise JudgeParseError(f"{len(values)} verdicts that disagree "
                                  f"({', '.join(map(repr, found[:4]))})")
        return values[0] if self.pick == "first" else values[-1]

    def _value(self, group: str) -> float:
        if self.kind == "choices":
            return dict(self.choices)[group.lower()]
        s = group.strip()
        if len(s) > MAX_NUMBER_CHARS:
            raise JudgeParseError(f"score of {len(s)} characters")
        if not _DECIMAL.fullmatch(s):
            raise JudgeParseError(f"score {s!r} is not a decimal number")
        x = float(s)
        if not math.isfinite(x):  # "1" × 400 digits would be inf; refused above, kept safe
            raise JudgeParseError(f"score {s!r} is not finite")
        if not self.score_min <= x <= self.score_max:
            raise JudgeParseError(f"score {x:g} outside [{self.score_min:g}, "
                                  f"{self.score_max:g}]")
        if self.normalize:
            return (x - self.score_min) / (self.score_max - self.score_min)
        return x
