"""`Conversation`: one line that calls served tools, round by round: the calls of a round
sent, their answers appended as `tool` messages, the line run again from there, and at
the end one result line that is the whole transcript.

Each round is a `Job` of its own for the engine (the line's own, with the conversation
so far as its messages): its prompt starts with the previous round's prompt and output,
whose keys a row still holds, so the prefix cache feeds only what is new. The rounds after
the first may answer in text whatever the line's `tool_choice` (a `required` or named
choice forces the first round's calls, not every round's).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from aici_cli.control.tool_calls import call_id
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.core.line_stats import ZERO_STATS, summed_stats
from aici_cli.formats.jobs.tools import tool_constraint
from aici_cli.run.tools.calls import CallOutcome


def served_line(job: Job, served: dict[str, Any]) -> bool:
    """Whether `job` runs as a conversation: it shows the model a served tool, and has one
    sample (the samples of a line would each need a conversation of their own)."""
    return (job.n == 1 and not job.score and job.messages is not None
            and any(tool["function"]["name"] in served for tool in job.tools or ()))


class Conversation:
    """A line in its rounds (see the module docstring)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.rounds = 0  # rounds of calls sent
        self.calls = 0  # calls made, for the next call's id
        self.transcript: list[dict[str, Any]] = []  # the result's `transcript`
        self.messages: list[dict[str, Any]] = list(job.messages or [])  # what the model sees
        self.stats: list[dict[str, Any]] = []  # each finished round's result's stats
        self.pending: list[tuple[dict[str, Any], Future[CallOutcome]]] = []

    def calls_to_run(self, result: dict[str, Any], served: dict[str, Any],
                     max_rounds: int) -> list[tuple[str, str]] | None:
        """The (name, arguments) of the calls `result` makes when the host runs them
        all: every one names a served tool and rounds are left; else None (the result
        ends the line, its calls handed back)."""
        calls = result.get("tool_calls")
        if result.get("finish_reason") != "tool_calls" or not calls \
                or self.rounds >= max_rounds:
            return None
        named = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return named if all(name in served for name, _ in named) else None

    def sent(self, result: dict[str, Any], calls: list[tuple[str, str]],
             futures: list[Future[CallOutcome]]) -> None:
        """A round's calls went out: its assistant message joins the conversation."""
        self.rounds += 1
        self.stats.append(result["stats"])
        made = []
        for (name, arguments), future in zip(calls, futures):
            made.append({"id": call_id(self.job.index, self.job.id, 0, self.calls),
                         "type": "function",
                         "function": {"name": name, "arguments": arguments}})
            self.calls += 1
            self.pending.append((made[-1], future))
        message = {"role": "assistant", "content": None, "tool_calls": made}
        self.messages.append(message)
        self.transcript.append(message)

    def answered(self) -> tuple[str, str] | None:
        """The round's answers join the conversation (each as a `tool` message); the
        first host error among them, which ends the line, or None."""
        failed = None
        for call, future in self.pending:
            outcome = future.result()
            entry: dict[str, Any] = {"role": "tool", "tool_call_id": call["id"],
                                     "name": call["function"]["name"],
                                     "server": outcome.server, "ms": outcome.ms}
            if outcome.error is not None:
                entry["content"] = None
                entry["error"] = {"type": outcome.error[0], "message": outcome.error[1]}
                failed = failed or outcome.error
            else:
                entry["content"] = outcome.content
                if outcome.is_error:
                    entry["is_error"] = True
            self.transcript.append(entry)
            self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": outcome.content or ""})
        self.pending = []
        return failed

    def next_round(self) -> Job:
        """The line again, with the conversation so far: the next round's job."""
        return dataclasses.replace(self.job, messages=list(self.messages),
                                   constraint=self._next_constraint())

    def _next_constraint(self) -> Constraint | None:
        constraint = self.job.constraint
        spec = constraint.value if constraint is not None and constraint.kind == "tool_calls" \
            else {}
        made = tool_constraint({"messages": self.messages, "tools": self.job.tools,
                                "tool_choice": "auto",
                                "parallel_tool_calls": spec.get("parallel", True)},
                               max_depth=1000)  # the line's tools passed its checks already
        if not isinstance(made, Constraint):
            return constraint
        return dataclasses.replace(made, permissive=constraint.permissive) \
            if constraint is not None else made

    def final(self, result: dict[str, Any]) -> dict[str, Any]:
        """The line's result: its last round's, with the transcript (ending in the final
        answer) and the stats of every round."""
        out = dict(result)
        last: dict[str, Any] = {"role": "assistant", "content": result.get("text", "")}
        if "tool_calls" in result:  # calls handed back unrun: ids that follow the run ones
            out["tool_calls"] = [{**c, "id": call_id(self.job.index, self.job.id, 0,
                                                     self.calls + k)}
                                 for k, c in enumerate(result["tool_calls"])]
            last = {"role": "assistant", "content": None, "tool_calls": out["tool_calls"]}
        if result.get("finish_reason") != "error":
            self.transcript.append(last)
        out["transcript"] = self.transcript
        out["stats"] = self._stats([*self.stats, result.get("stats", {})])
        return out

    def failed(self, error: tuple[str, str]) -> dict[str, Any]:
        """The line's error result after a call that cost it (`error`), with the
        transcript up to that call."""
        job = self.job
        return {"id": job.id, "index": job.index, "text": "", "finish_reason": "error",
                "error": {"type": error[0], "message": f"line {job.index}: {error[1]}"},
                "transcript": self.transcript, "stats": self._stats(self.stats)}

    @staticmethod
    def _stats(rounds: list[dict[str, Any]]) -> dict[str, Any]:
        """The rounds' work added up; `total_ms` from the first round's start to the last
        one's end, the tools' time in it."""
        rounds = [s for s in rounds if s]
        if not rounds:
            return dict(ZERO_STATS)
        stats = summed_stats([{"stats": s} for s in rounds])
        ends = [s.get("started_ms", 0.0) + s.get("total_ms", 0.0) for s in rounds]
        stats["total_ms"] = round(max(ends) - stats["started_ms"], 3)
        return stats
