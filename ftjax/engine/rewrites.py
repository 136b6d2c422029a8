"""How an agent rewrites its own history, learned from its requests, so that the engine
can prefill the next history while the agent's tool runs.

Agents resend their whole history every turn and rewrite it on the way: old tool
outputs trimmed or replaced by a placeholder, old reasoning dropped. Prefix reuse stops
at the first rewritten token, so the rest is prefilled again — yet the rewrite is
regular, and between a response and the next request the engine is idle.

A conversation is a sequence of requests (messages lists). Messages keep their index
from one request to the next (rewrites change content, they do not delete), so each
message has an age: how many requests ago its index first appeared. Diffing request N
with request N+1 message by message gives a `Rule`, data that says

    tool_trim               how an old tool output is rewritten: its first `keep_lines`
                            lines and a marker ("{dropped}" = lines dropped; keep_lines 0
                            and a constant marker = a placeholder)
    tool_age / tool_newer   which are old: this many requests old, or with this many newer
                            tool outputs after them ("keep the last k"); both are learned,
                            and the one that predicts better is used
    reasoning_age           assistant messages this many requests old lose their
                            reasoning_content

(the youngest age at which a change was seen: older messages were changed before).
Applied to request N+1 with the ages of request N+2, the rule predicts how request N+2
begins; `RewriteTracker.observe` returns that prediction when the rule is confident (at
least half of its predictions were right since it last changed; a new rule is tried). Whatever else changes
(a re-serialised tool call) the rule does not predict: the engine measures how often the
prediction was exact, and a wrong one costs idle compute only — the engine reuses a
predicted state only on an exact token match (the state cache's restore).

A conversation is known by its first two messages (system and first user message); the
tracker keeps the most recent `max_conversations`.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trim:
    keep_lines: int
    marker: str  # the last line; "{dropped}" stands for the number of lines dropped

    def apply(self, text: str) -> str:
        rows = text.split("\n")
        if self.matches(text) or len(rows) <= self.keep_lines:
            return text
        return "\n".join(rows[:self.keep_lines] + [self.marker.replace("{dropped}", str(len(rows) - self.keep_lines))])

    def matches(self, text: str) -> bool:
        """Already in this form (a rewrite is applied once)."""
        rows = text.split("\n")
        pattern = re.escape(self.marker).replace(re.escape("{dropped}"), r"\d+")
        return len(rows) == self.keep_lines + 1 and re.fullmatch(pattern, rows[-1]) is not None

    @staticmethod
    def learn(before: str, after: str) -> Trim | None:
        """The trim that turns `before` into `after`, if `after` is leading lines of it
        and one marker line."""
        rows, new = before.split("\n"), after.split("\n")
        keep = len(new) - 1
        if keep < 0 or keep >= len(rows) or rows[:keep] != new[:keep]:
            return None
        dropped = str(len(rows) - keep)
        marker = new[-1].replace(dropped, "{dropped}", 1) if dropped in new[-1] else new[-1]
        return Trim(keep, marker)


@dataclass(frozen=True)
class Rule:
    tool_age: int | None = None  # tool outputs this many requests old (or older) are trimmed ...
    tool_newer: int | None = None  # ... or: those with this many newer tool outputs after them
    tool_trim: Trim | None = None
    reasoning_age: int | None = None

    @property
    def rewrites(self) -> bool:
        return self.tool_trim is not None or self.reasoning_age is not None

    def apply(self, messages: list[dict], ages: list[int], by: str = "age", added_tools: int = 1) -> list[dict]:
        """messages rewritten for a request at which message j is ages[j] requests old and
        `added_tools` tool outputs are new; by: which tool rule, "age" or "newer"."""
        is_tool = [m.get("role") == "tool" for m in messages]
        newer = [sum(is_tool[j + 1:]) + added_tools for j in range(len(messages))]
        out = []
        for j, (m, age) in enumerate(zip(messages, ages)):
            m = dict(m)
            if (is_tool[j] and self.tool_trim is not None and isinstance(m.get("content"), str)
                    and (age >= self.tool_age if by == "age" else newer[j] >= self.tool_newer)):
                m["content"] = self.tool_trim.apply(m["content"])
            if m.get("role") == "assistant" and self.reasoning_age is not None and age >= self.reasoning_age:
                m.pop("reasoning_content", None)
            out.append(m)
        return out


def learn(before: list[dict], after: list[dict], ages: list[int]) -> Rule:
    """The rule seen between two consecutive requests: `before` (request N), `after`
    (request N+1, at least as long), ages[j] = how old message j is at request N+1.
    Thresholds are the smallest at which a change was seen (older ones changed before)."""
    tool_age = tool_newer = reasoning_age = trim = None
    is_tool = [m.get("role") == "tool" for m in after]
    for j, (m, n, age) in enumerate(zip(before, after, ages)):
        if is_tool[j] and m.get("content") != n.get("content") and isinstance(m.get("content"), str) \
                and isinstance(n.get("content"), str):
            t = Trim.learn(m["content"], n["content"])
            if t is not None:
                trim = t
                tool_age = age if tool_age is None else min(tool_age, age)
                newer = sum(is_tool[j + 1:])
                tool_newer = newer if tool_newer is None else min(tool_newer, newer)
        if m.get("role") == "assistant" and "reasoning_content" in m and "reasoning_content" not in n:
            reasoning_age = age if reasoning_age is None else min(reasoning_age, age)
    return Rule(tool_age, tool_newer, trim, reasoning_age)


@dataclass
class Conversation:
    messages: list[dict]
    first_seen: list[int]  # the request number at which each message index first appeared
    requests: int = 1
    rule: Rule | None = None
    added_tools: int = 1  # tool outputs the next request is assumed to add (as many as the last, at least 1)
    scores: dict = field(default_factory=lambda: {"newer": [0, 0], "age": [0, 0]})  # tool rule: [right, tried]
    candidates: dict = field(default_factory=dict)  # by tool rule: the predicted beginning of the next request
    predicted: list[dict] | None = None  # the prediction given out (the best-scoring rule's)
    predicted_ids: list[int] | None = None  # ... as prompt tokens (the engine's rendering)

    def best(self) -> str:
        """The tool rule that predicted best since the rule last changed (ties: "newer")."""
        rate = {by: (r + 1) / (t + 2) for by, (r, t) in self.scores.items()}
        return max(rate, key=lambda by: (rate[by], by == "newer"))


@dataclass
class RewriteTracker:
    max_conversations: int = 256
    counters: dict = field(default_factory=lambda: {"requests": 0, "predictions": 0, "predicted_right": 0,
                                                    "predicted_wrong": 0})
    _conversations: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    @staticmethod
    def key(messages: list[dict]) -> str:
        return hashlib.sha256(json.dumps(messages[:2], sort_keys=True, default=str).encode()).hexdigest()

    def peek(self, messages: list[dict]) -> Conversation | None:
        """The conversation these messages continue, if known (nothing changes)."""
        return self._conversations.get(self.key(messages))

    def observe(self, messages: list[dict]) -> tuple[Conversation, list[dict] | None]:
        """A request's messages -> (its conversation, the predicted beginning of the next
        request, or None when the rule predicts no rewrite or is not confident)."""
        self.counters["requests"] += 1
        key = self.key(messages)
        conv = self._conversations.pop(key, None)
        if conv is None or len(messages) < len(conv.messages):  # new, or not a continuation
            conv = Conversation(copy.deepcopy(messages), [0] * len(messages))
        else:
            before = conv.messages
            if conv.predicted is not None:
                right = messages[:len(conv.predicted)] == conv.predicted
                self.counters["predicted_right" if right else "predicted_wrong"] += 1
            for by, guess in conv.candidates.items():
                score = conv.scores[by]
                score[0] += messages[:len(guess)] == guess
                score[1] += 1
            ages = [conv.requests - s for s in conv.first_seen]
            seen, old = learn(before, messages, ages), conv.rule or Rule()
            rule = Rule(*((seen.tool_age, seen.tool_newer, seen.tool_trim) if seen.tool_trim else
                          (old.tool_age, old.tool_newer, old.tool_trim)),
                        old.reasoning_age if seen.reasoning_age is None else seen.reasoning_age)  # quiet turns keep it
            if rule != conv.rule:  # something new was learned: its confidence starts afresh
                conv.rule, conv.scores = rule, {"newer": [0, 0], "age": [0, 0]}
            # a turn without tool output (a user message) is usually followed by one that has one
            conv.added_tools = max(1, sum(m.get("role") == "tool" for m in messages[len(before):]))
            conv.first_seen += [conv.requests] * (len(messages) - len(before))
            conv.messages, conv.requests = copy.deepcopy(messages), conv.requests + 1
        self._conversations[key] = conv
        while len(self._conversations) > self.max_conversations:
            self._conversations.popitem(last=False)
        conv.predicted = conv.predicted_ids = None
        conv.candidates = {}
        if conv.rule is None or not conv.rule.rewrites:
            return conv, None
        ages = [conv.requests - s for s in conv.first_seen]  # at the next request
        conv.candidates = {by: conv.rule.apply(conv.messages, ages, by, conv.added_tools) for by in conv.scores}
        by = conv.best()
        right, tried = conv.scores[by]
        predicted = conv.candidates[by]
        if predicted == conv.messages or (tried and right * 2 < tried):  # no change, or not confident
            return conv, None
        conv.predicted = predicted
        self.counters["predictions"] += 1
        return conv, predicted
