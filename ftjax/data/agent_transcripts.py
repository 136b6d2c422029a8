"""Synthetic multi-turn agent transcripts for `ftjax bench agent` (deterministic, offline).

A transcript is a script of steps. Step i holds the messages that arrive (a user message,
or the tool results of the previous step's calls) and the scripted assistant reply the
agent framework appends to its history afterwards (reasoning, text, tool calls). Request
i is the history of steps 0..i-1, rewritten for request i, plus step i's new messages:

    request 0:  system, user_0
    request 1:  system, user_0, reply_0 (+reasoning), tool_1
    request 2:  system, user_0, reply_0, reply_1 (+reasoning), tool_1, tool_2 ...

The replies are scripted, never the model's own output (a random-weight model writes
garbage), so every server mode sees exactly the same prompts.

Between requests the history is rewritten the way real agent frameworks do it; each
rewrite changes text the server has seen before, which breaks a plain prefix match:

    (a) reasoning: only the latest assistant message keeps its `reasoning_content`
        (reasoning="latest") or none does (reasoning="none")
    (b) trimming: a tool output `trim_after` requests old keeps its first `trim_lines`
        lines plus "[... trimmed N lines]"
    (c) re-echo: from request `echo_at` on, the tool call of step `echo_of` is sent
        re-serialised (keys reversed, compact separators): same name and arguments,
        different text
    (d) eliding (`keep_last_tool_outputs(k)`, instead of (a)-(c)): every tool output
        but the last k replaced by a placeholder, as coding agents do

Workloads: `coding` (a code-editing agent: list_files / read_file / edit_file /
run_tests, long tool outputs: listings, code, test logs; replayed with the OpenAI SDK)
and `assistant` (a customer-support assistant with a long system prompt and eight
tools; replayed with the Anthropic SDK). Messages are OpenAI chat messages
(`tool_calls`, role "tool", `tool_call_id`); `to_anthropic` converts a request to the
Messages API (system, tool_use / tool_result blocks). `scale` multiplies the long parts
(system prompt, tool outputs); at scale 1 every request fits the embedded model's
2048-token context. Text is plain ASCII English and code.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from dataclasses import dataclass, field

TRIM_MARK = "[... trimmed"
ELIDED = "[tool output elided]"


@dataclass
class Step:
    inputs: list[dict]  # the user message, or the tool messages answering the last reply's calls
    reply: dict  # the scripted assistant message appended to the history after this request


@dataclass
class Workload:
    name: str
    api: str  # the SDK the bench replays it with: "openai" | "anthropic"
    system: str
    tools: list[dict]  # OpenAI function tools
    steps: list[Step] = field(default_factory=list)
    reasoning: str = "latest"  # rewrite (a): "latest" | "none" | "all" (kept: no rewrite)
    trim_after: int = 2  # rewrite (b): tool outputs this many requests old are trimmed ...
    trim_lines: int = 3  # ... to their first lines
    echo_of: int = 1  # rewrite (c): the step whose tool call is re-echoed ...
    echo_at: int = 6  # ... from this request on
    elide_keep: int | None = None  # rewrite (d): all but the last `elide_keep` tool outputs become ELIDED

    def __len__(self) -> int:
        return len(self.steps)

    def request(self, i: int) -> list[dict]:
        """The messages of request i: the rewritten history plus step i's inputs."""
        out = self._request(i)
        if self.elide_keep is not None:
            tools = [m for m in out if m["role"] == "tool"]
            for m in tools[:max(0, len(tools) - self.elide_keep)]:
                m["content"] = ELIDED
        return out

    def _request(self, i: int) -> list[dict]:
        out = [{"role": "system", "content": self.system}]
        for k, step in enumerate(self.steps[: i + 1]):
            for m in step.inputs:
                m = dict(m)
                if m["role"] == "tool" and i - k >= self.trim_after:
                    m["content"] = trim(m["content"], self.trim_lines)
                out.append(m)
            if k == i:
                break
            reply = copy.deepcopy(step.reply)
            if "reasoning_content" in reply and (self.reasoning == "none" or self.reasoning == "latest" and k < i - 1):
                del reply["reasoning_content"]
            if k == self.echo_of and i >= self.echo_at:
                fn = reply["tool_calls"][0]["function"]
                fn["arguments"] = reecho(fn["arguments"])
            out.append(reply)
        return out

    def requests(self) -> list[list[dict]]:
        return [self.request(i) for i in range(len(self.steps))]

    def keep_last_tool_outputs(self, k: int) -> "Workload":
        """The same conversation sent by an agent that replaces every tool output but the
        last k with a placeholder (and otherwise never rewrites)."""
        return dataclasses.replace(self.append_only(), elide_keep=k)

    def for_session(self, k: int) -> "Workload":
        """The same conversation as agent session k sends it: its own system prompt, so
        concurrent sessions share no prefix beyond the chat template's."""
        return dataclasses.replace(self, system=f"[session {k}] {self.system}") if k else self

    def append_only(self) -> "Workload":
        """The same conversation sent as an agent that never rewrites its history: every
        request extends the previous one (reasoning kept, nothing trimmed or re-echoed)."""
        return dataclasses.replace(self, reasoning="all", trim_after=len(self.steps) + 1, echo_at=len(self.steps) + 1)


def trim(text: str, lines: int) -> str:
    """The first `lines` lines and a marker saying how many were dropped (short text as is)."""
    rows = text.split("\n")
    if len(rows) <= lines + 1:
        return text
    return "\n".join(rows[:lines] + [f"{TRIM_MARK} {len(rows) - lines} lines]"])


def reecho(arguments: str) -> str:
    """The same JSON object, keys reversed and compact separators (as a framework that
    re-serialises its history would send it)."""
    obj = json.loads(arguments)
    return json.dumps(dict(reversed(list(obj.items()))), separators=(",", ":"))


# ---- building scripts ------------------------------------------------------------------------

def _tool(name: str, description: str, props: dict[str, str], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props.items()},
                       "required": required}}}


class _Script:
    """Appends steps: `user` / `results` queue the inputs, `reply` closes the step."""

    def __init__(self, prefix: str):
        self.prefix, self.steps, self.inputs, self.calls, self.n = prefix, [], [], [], 0

    def user(self, text: str) -> None:
        self.inputs.append({"role": "user", "content": text})

    def results(self, *outputs: str) -> None:
        """The tool outputs answering the last reply's calls, in order."""
        assert len(outputs) == len(self.calls), "one output per tool call"
        self.inputs += [{"role": "tool", "tool_call_id": c["id"], "content": o} for c, o in zip(self.calls, outputs)]

    def reply(self, reasoning: str, content: str | None = None, calls: list[tuple[str, dict]] = ()) -> None:
        msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        self.calls = []
        for name, args in calls:
            self.n += 1
            self.calls.append({"id": f"call_{self.prefix}_{self.n:02d}", "type": "function",
                               "function": {"name": name, "arguments": json.dumps(args)}})
        if self.calls:
            msg["tool_calls"] = self.calls
        self.steps.append(Step(self.inputs, msg))
        self.inputs = []


def _n(base: int, scale: float) -> int:
    return max(1, round(base * scale))


# ---- coding: a code-editing agent ----------------------------------------------------------------

UNITS = [("seconds", "s", 1), ("minutes", "m", 60), ("hours", "h", 3600), ("days", "d", 86400)]
WORDS = ["cache", "config", "parser", "units", "format", "errors", "clock", "report", "window", "limits",
         "schedule", "buffer", "router", "session", "locale", "metrics", "retry", "export"]
CODING_SYSTEM = """You are a careful coding agent working in a Python repository.
Read a file before you edit it, keep edits small and exact, and run the tests after every
change. When the task is done, say what you changed and why in one short paragraph."""
CODING_TOOLS = [
    _tool("read_file", "Read lines of a text file.", {"path": "string", "max_lines": "integer"}, ["path"]),
    _tool("edit_file", "Replace an exact text span in a file.", {"path": "string", "old": "string", "new": "string"},
          ["path", "old", "new"]),
    _tool("run_tests", "Run pytest on a file or folder.", {"target": "string", "verbose": "boolean"}, ["target"]),
]


def _code(n: int, bug: bool) -> str:
    rows = ['"""Parse durations such as 90s or 2h into seconds."""', "import re", "",
            "UNITS = {" + ", ".join(f'"{s}": {m}' for _, s, m in UNITS) + "}", ""]
    for i in range(n - 1):
        unit, suffix, mult = UNITS[i % len(UNITS)]
        rows += [f"def parse_{unit}(text):", f'    return int(text.removesuffix("{suffix}")) * {mult}', ""]
    rows += ["def parse_duration(text):", '    m = re.fullmatch(r"(\\d+)([a-z]+)", text)',
             "    return int(m[1]) * UNITS[m[2]]" + (" - 1" if bug else "")]
    return "\n".join(rows)


def _tests(n: int) -> str:
    rows = ["from timeparse.core import parse_duration", ""]
    for i in range(n):
        unit, suffix, mult = UNITS[i % len(UNITS)]
        rows += [f"def test_{unit}_{i + 2}():", f'    assert parse_duration("{i + 2}{suffix}") == {(i + 2) * mult}', ""]
    return "\n".join(rows)


def _log(rng: random.Random, n: int, failed: bool, verbose: bool = True) -> str:
    rows = [f"collected {n} items"]
    bad = 0
    for i in range(n):
        fail = failed and i % 4 == 1
        bad += fail
        if verbose:
            rows.append(f"tests/test_core.py::test_{UNITS[i % len(UNITS)][0]}_{i + 2} {'FAILED' if fail else 'ok'}")
    if failed:
        rows += ['E  assert parse_duration("3m") == 180', "E  assert 179 == 180"]
    rows.append(f"{bad} failed, {n - bad} passed in {rng.uniform(0.2, 2.0):.2f}s")
    return "\n".join(rows)


def coding(scale: float = 1.0) -> Workload:
    rng = random.Random(1)
    s = _Script("code")
    src, tests = "src/timeparse/core.py", "tests/test_core.py"
    s.user("parse_duration('3m') returns 179, not 180. Find the bug, fix it, and make sure the tests pass.")
    s.reply("An off-by-one somewhere. Run the tests first to see what fails.",
            calls=[("run_tests", {"target": tests, "verbose": True})])
    s.results(_log(rng, _n(10, scale), failed=True))
    s.reply(f"Every minutes test is one short. Read {src} before editing it.",
            calls=[("read_file", {"path": src, "max_lines": 200})])
    s.results(_code(_n(6, scale), bug=True))
    s.reply("parse_duration subtracts 1 from the product: that is the bug. Remove it with an exact edit.",
            calls=[("edit_file", {"path": src, "old": "] - 1", "new": "]"})])
    s.results("Applied 1 edit to src/timeparse/core.py.")
    s.reply("Edit applied. Run the tests again.", calls=[("run_tests", {"target": tests})])
    s.results(_log(rng, _n(10, scale), failed=False, verbose=False))
    s.reply("All green. Report the fix.", content="Fixed: parse_duration subtracted 1 from every result. "
                                                  "The stray - 1 is gone and the tests pass.")
    s.user("Thanks. Now add milliseconds with the suffix ms, and a test for it.")
    s.reply("Check which types the tests expect before adding a fractional unit.",
            calls=[("read_file", {"path": tests, "max_lines": 100})])
    s.results(_tests(_n(6, scale)))
    s.reply("Plain asserts on numbers. Add a test for 1500ms first.",
            calls=[("edit_file", {"path": tests, "old": "parse_duration\n", "new": "parse_duration\n\n"
                                  "def test_ms():\n    assert parse_duration('1500ms') == 1.5\n"})])
    s.results("Applied 1 edit to tests/test_core.py.")
    s.reply("Now add ms as 0.001 to the unit table.",
            calls=[("edit_file", {"path": src, "old": "UNITS = {", "new": 'UNITS = {"ms": 0.001, '})])
    s.results("Applied 1 edit to src/timeparse/core.py.")
    s.reply("Run the whole test folder.", calls=[("run_tests", {"target": "tests"})])
    s.results(_log(rng, _n(11, scale), failed=False, verbose=False))
    s.reply("Everything passes.", content="Added the ms suffix (0.001 s) to UNITS and test_ms; the suite passes.")
    s.user("Great. Write a one-line commit message for both changes.")
    s.reply("Summarise both fixes in one line.", content="Fix off-by-one in parse_duration; add ms unit.")
    return Workload("coding", "openai", CODING_SYSTEM, CODING_TOOLS, s.steps, reasoning="latest",
                    trim_after=2, trim_lines=2, echo_of=1, echo_at=6)


def coding_loop(scale: float = 1.0, cycles: int = 14) -> Workload:
    """A long coding session: one task, then `cycles` rounds of read a module, edit it,
    run its tests (3 tool steps each: 43 requests at 14 cycles). Too long for the embedded
    model's 2,048 tokens unless old tool outputs are elided; meant for
    `keep_last_tool_outputs(k)` on the embedded weights at a longer declared context
    (`ftjax.bench.models.default_model_with_context`), where the conversation runs
    for many turns after its rewrite rule can be learned. Not in `names()` (the default
    replay set): `build("coding-loop")`."""
    rng = random.Random(3)
    s = _Script("loop")
    s.user("Every parser module under src/timeparse/ rounds instead of truncating. Go through them one by one: "
           "read each, fix it, and run its tests before moving on.")
    for c in range(cycles):
        module, tests = f"src/timeparse/unit_{c:02d}.py", f"tests/test_unit_{c:02d}.py"
        if c:
            s.results(_log(rng, _n(8, scale), failed=False, verbose=False))
        s.reply(f"Next module: unit_{c:02d}. Read it before editing.",
                calls=[("read_file", {"path": module, "max_lines": 200})])
        s.results(_code(_n(5 + c % 3, scale), bug=True))
        s.reply(f"unit_{c:02d} subtracts 1 from the product too. Remove it with an exact edit.",
                calls=[("edit_file", {"path": module, "old": "] - 1", "new": "]"})])
        s.results(f"Applied 1 edit to {module}.")
        s.reply(f"Run the tests of unit_{c:02d}.", calls=[("run_tests", {"target": tests, "verbose": c % 2 == 0})])
    s.results(_log(rng, _n(8, scale), failed=False, verbose=False))
    s.reply("Every module is fixed.", content=f"Fixed the off-by-one in all {cycles} parser modules; tests pass.")
    return Workload("coding-loop", "openai", CODING_SYSTEM, CODING_TOOLS, s.steps, reasoning="latest",
                    trim_after=2, trim_lines=2, echo_of=1, echo_at=6)


# ---- assistant: a tool-using support assistant with a long system prompt -----------------------

POLICY = {
    "Tone": ["Greet the customer once, by first name when it is known.",
             "Write short paragraphs and plain words; apologise once for a real problem, never for policy."],
    "Orders": ["Look orders up by the customer's email address before asking for an order number.",
               "Never promise a delivery date the carrier has not given."],
    "Returns": ["Items may be returned within 30 days of delivery if unused; used tents within 60 days.",
                "Offer a prepaid return label for orders over 50 dollars."],
    "Cancellations": ["An order may be cancelled until it is handed to the carrier; after that, offer a return."],
    "Stores": ["Store pickup holds an item for 48 hours; give the store's address and opening hours."],
    "Privacy": ["Never read back a full card number or address; the last four digits and the city are enough.",
                "Send confirmations only to the email address on the account."],
    "Escalation": ["Hand over to a human agent when the customer asks for one twice.",
                   "Escalate any request for a refund above 500 dollars."],
    "Warranty": ["Stoves and headlamps carry a two year warranty; tents carry one year against seam failure."],
    "Shipping": ["Standard shipping is free over 75 dollars and takes three to six business days."],
    "Price matching": ["Match the price of an identical item sold by a listed competitor within 14 days."],
}
ASSISTANT_TOOLS = [
    _tool("search_orders", "Find a customer's orders.", {"email": "string", "status": "string"}, ["email"]),
    _tool("get_order", "One order with items and tracking.", {"order_id": "string"}, ["order_id"]),
    _tool("reserve_item", "Hold an item for store pickup.", {"sku": "string", "city": "string"}, ["sku", "city"]),
    _tool("send_email", "Email the customer.", {"to": "string", "subject": "string", "body": "string"},
          ["to", "subject", "body"]),
]
CITIES = ["Portland", "Salem", "Eugene", "Bend", "Medford", "Corvallis", "Hillsboro", "Gresham", "Beaverton"]


def _assistant_system(scale: float) -> str:
    rows = ["You are the support assistant of Northwind Outfitters, an outdoor gear shop with stores in Oregon.",
            "Answer customers in chat. Use the tools to look things up; never guess order data."]
    sections = list(POLICY.items())
    for i in range(_n(5, scale)):
        name, rules = sections[i % len(sections)]
        rows.append(f"{name}" + (f" (part {i // len(sections) + 1})" if i >= len(sections) else "") + ":")
        rows += [f"- {r}" for r in rules]
    return "\n".join(rows)


def _orders(rng: random.Random, n: int) -> str:
    rows = []
    for i in range(n):
        status = "shipped" if i == 0 else ["delivered", "returned", "delivered"][i % 3]
        rows.append(f"NW-{48213 - 97 * i} May {20 - 2 * i} {status} ${rng.randint(20, 400)}")
    return "\n".join(rows)


def _order(order: str, item: str, n: int) -> str:
    events = ["arrived at facility", "departed facility", "in transit", "delayed by weather"]
    rows = [f"{order}: {item}, shipped May 18 by UPS, card ending 4421"]
    rows += [f"May {19 + i // 2} {CITIES[i % len(CITIES)]}: {events[i % 4]}" for i in range(n)]
    return "\n".join(rows)


def assistant(scale: float = 1.0) -> Workload:
    rng = random.Random(2)
    s = _Script("asst")
    email, order = "dana@example.com", "NW-48213"
    s.user(f"Hi, I ordered a tent two weeks ago and it still has not arrived. My email is {email}.")
    s.reply("Look up the customer's orders by email first, as the policy says.",
            calls=[("search_orders", {"email": email, "status": "any"})])
    s.results(_orders(rng, _n(7, scale)))
    s.reply(f"{order} is the only shipped order. Get its items and tracking.",
            calls=[("get_order", {"order_id": order})])
    s.results(_order(order, "Ridge 2 tent (RT2), $189", _n(7, scale)))
    s.reply("Weather delay and no date from the carrier: do not promise one.",
            content="Hi Dana, your Ridge 2 tent is with UPS and delayed by weather; UPS has no new date yet.")
    s.user("I leave on Friday. Can I cancel it and pick the same tent up in a store instead?")
    s.reply("It has shipped, so no cancellation; offer a return and a pickup in Portland.",
            calls=[("reserve_item", {"sku": "RT2", "city": "Portland"})])
    s.results("held RT2 at Northwind Portland, 1020 SW Morrison St, open 9-7, until May 24 6pm, code PX-7731")
    s.reply("Held. Tell the customer and offer an email.",
            content="It has shipped, so I cannot cancel it, but you can return it. I have held a Ridge 2 at our "
                    "Portland store (1020 SW Morrison St, 9-7) until May 24. Shall I email you the details?")
    s.user("Yes please, email me the details.")
    s.reply("Send the pickup details to the account email.",
            calls=[("send_email", {"to": email, "subject": "Tent on hold", "body": "Code PX-7731, until May 24."})])
    s.results("sent")
    s.reply("Confirm.", content="Done, the pickup code is in your inbox.")
    s.user("Thanks! One more thing: did my older order with the stove arrive?")
    s.reply("The stove order is one of the delivered ones; check it.",
            calls=[("get_order", {"order_id": "NW-48116"})])
    s.results(_order("NW-48116", "Trail stove (TS1), $64", _n(3, scale)) + "\nMay 6 Portland: delivered")
    s.reply("Delivered on May 6.", content="Yes: your Trail stove was delivered on May 6.")
    s.user("It does not light any more. Can I still return it?")
    s.reply("Past 30 days for unused items, but stoves have a two year warranty.",
            content="It is covered by our two year warranty on stoves. I can email you a prepaid label.")
    s.user("Yes, send me the label please.")
    s.reply("Send the label to the account email.",
            calls=[("send_email", {"to": email, "subject": "Warranty return", "body": "Label for NW-48116."})])
    s.results("sent")
    return Workload("assistant", "anthropic", _assistant_system(scale), ASSISTANT_TOOLS, s.steps, reasoning="none",
                    trim_after=2, trim_lines=2, echo_of=0, echo_at=6)


BUILDERS = {"coding": coding, "assistant": assistant}  # the default replay set
LONG = {"coding-loop": coding_loop}  # by name only: longer than the embedded model's context


def names() -> list[str]:
    return list(BUILDERS)


def all_names() -> list[str]:
    return list(BUILDERS) + list(LONG)


def build(name: str, scale: float = 1.0) -> Workload:
    if name not in BUILDERS and name not in LONG:
        raise ValueError(f"unknown workload {name!r} (one of {', '.join(all_names())})")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return {**BUILDERS, **LONG}[name](scale)


def workloads(scale: float = 1.0) -> dict[str, list[list[dict]]]:
    """Per workload, the messages of every request in order (OpenAI chat format)."""
    return {n: build(n, scale).requests() for n in BUILDERS}


def tools(name: str) -> list[dict]:
    return build(name).tools


# ---- Anthropic Messages API form -------------------------------------------------------------------

def anthropic_tools(tools: list[dict]) -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


def to_anthropic(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """OpenAI chat messages -> (system, Anthropic messages): reasoning as a thinking block,
    tool calls as tool_use blocks (arguments parsed, key order kept), tool messages as
    tool_result blocks of a user message; consecutive messages of one role are merged."""
    system, out = None, []
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
            continue
        if m["role"] == "tool":
            role, blocks = "user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]
        elif m["role"] == "user":
            role, blocks = "user", [{"type": "text", "text": m["content"]}]
        else:
            role, blocks = "assistant", []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(c["function"]["arguments"])})
        if out and out[-1]["role"] == role:
            out[-1]["content"] += blocks
        else:
            out.append({"role": role, "content": blocks})
    return system, out
