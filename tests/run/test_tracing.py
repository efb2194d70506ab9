"""Host-side tracing: `run --trace FILE` writes OTLP JSON whose span tree matches the run's
lines, steps and guest calls (parsed with the protobuf JSON mapping into OTLP's own
`TracesData`), and OTEL_EXPORTER_OTLP_ENDPOINT sends the same spans to a collector (a
real HTTP server on 127.0.0.1 that decodes OTLP/HTTP protobuf)."""

from __future__ import annotations

import base64
import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from wat import Guest, component, save

from aici_cli.cli.main import main

json_format = pytest.importorskip("google.protobuf.json_format")
trace_pb2 = pytest.importorskip("opentelemetry.proto.trace.v1.trace_pb2")
pytest.importorskip("opentelemetry.sdk")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# Forks into 3 at its first call; each branch samples 3 tokens and stops.
FORK_3 = Guest(
    """
    (if (local.get $has-branch) (then (global.set $since (i32.const 0))))
    (if (i32.lt_s (global.get $since) (i32.const 0)) (then (return (call $fork (i32.const 3)))))
    (global.set $since (i32.add (global.get $since) (i32.const 1)))
    (if (i32.gt_s (global.get $since) (i32.const 3)) (then (return (call $stop))))
    (call $sample-all)
    """,
    funcs=("(global $since (mut i32) (i32.const -1))",),
)


class Spans:
    """The spans of one trace, parsed as OTLP protobuf messages."""

    def __init__(self, spans: list[Any]) -> None:
        self.all = spans
        self.by_id = {s.span_id: s for s in spans}

    def named(self, prefix: str) -> list[Any]:
        return [s for s in self.all if s.name == prefix or s.name.startswith(prefix + " ")]

    def children(self, parent: Any, name: str | None = None) -> list[Any]:
        return [s for s in self.all if s.parent_span_id == parent.span_id
                and (name is None or s.name == name)]


def attrs(span_or_event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span_or_event.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def _hex_ids_to_base64(node: Any) -> None:
    """OTLP JSON writes trace and span ids as hex; the protobuf JSON mapping reads bytes as
    base64 (the one deviation the OTLP spec makes)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                node[key] = base64.b64encode(bytes.fromhex(value)).decode()
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)


def parse_otlp_json(path: Path) -> Spans:
    spans: list[Any] = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        _hex_ids_to_base64(doc)
        data = json_format.ParseDict(doc, trace_pb2.TracesData())  # unknown fields: an error
        for resource_spans in data.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    return Spans(spans)


def run(model: Path, tmp: Path, lines: list[str], *extra: str,
        env: dict[str, str] | None = None) -> tuple[int, dict[int, dict[str, Any]],
                                                    dict[str, Any]]:
    inp, out, stats = tmp / "in.jsonl", tmp / "out.jsonl", tmp / "stats.json"
    inp.write_text("".join(x + "\n" for x in lines))
    res = CliRunner(env=env).invoke(main, [
        "run", str(inp), "-o", str(out), "--model", str(model), "--dtype", "float32",
        "--device", "cpu", "-q", "--stats-out", str(stats), "--batch-size", "2", *extra])
    results = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    return res.exit_code, results, json.loads(stats.read_text())


def check_line_spans(spans: Spans, results: dict[int, dict[str, Any]]) -> dict[int, Any]:
    """One `line N` span per result, under the run span, saying what the result says."""
    (root,) = [s for s in spans.all if not s.parent_span_id]
    assert root.name == "run"
    assert len({s.trace_id for s in spans.all}) == 1
    lines = {attrs(s)["aici.line.index"]: s for s in spans.named("line")}
    assert sorted(lines) == sorted(results)
    for index, span in lines.items():
        result, a = results[index], attrs(span)
        assert span.parent_span_id == root.span_id
        assert a["gen_ai.response.finish_reasons"] == [
            c["finish_reason"] for c in result.get("choices", [result])]
        assert a["gen_ai.usage.input_tokens"] == result["stats"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == result["stats"]["output_tokens"]
        events = [e.name for e in span.events]
        assert events[-1] == "finished"
        times = [e.time_unix_nano for e in span.events]
        assert times == sorted(times)
        assert span.start_time_unix_nano <= times[0] and times[-1] <= span.end_time_unix_nano
        if result["stats"]["output_tokens"]:
            assert events[0] == "admitted" and "first_token" in events
        if result["finish_reason"] == "error":
            assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
            assert a["error.type"] == result["error"]["type"]
    return lines


def test_a_trace_file_holds_the_run_its_lines_and_steps(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"hello {i}", "max_tokens": 3 + i}) for i in range(4)]
    lines.insert(2, json.dumps({"prompt": "json please", "max_tokens": 12,
                                "json_schema": SCHEMA}))
    lines.append("not json")
    code, results, summary = run(tiny_model_dir, tmp_path, lines, "--trace",
                                 str(tmp_path / "trace.jsonl"))
    assert code == 1  # the bad line
    spans = parse_otlp_json(tmp_path / "trace.jsonl")
    line_spans = check_line_spans(spans, results)
    (root,) = spans.named("run")
    assert attrs(root)["gen_ai.request.model"] == summary["model"]
    assert attrs(root)["aici.lines"] == len(results) == 6
    assert len(spans.children(root, "load model")) == 1
    # The JSON line compiled its grammar during admission.
    json_line = next(i for i, r in results.items() if "valid" in r)
    compile_spans = spans.children(line_spans[json_line], "grammar compile")
    assert len(compile_spans) == 1
    assert attrs(compile_spans[0])["aici.grammar.kind"] == "json_schema"
    # One step span per forward pass, each linked to the lines it served: a line is
    # linked from exactly as many steps as it took part in.
    steps = spans.named("step")
    assert len(steps) == summary["forward_passes"]
    assert all(s.parent_span_id == root.span_id for s in steps)
    served: Counter[int] = Counter()
    for step in steps:
        linked = {spans.by_id[link.span_id].name for link in step.links}
        assert linked == {f"line {i}" for i in attrs(step)["aici.step.lines"]}
        served.update(attrs(step)["aici.step.lines"])
    for index, result in results.items():
        assert served[index] == result["stats"]["forward_passes"], index
    kinds = Counter(attrs(s)["aici.step.kind"] for s in steps)
    assert kinds["prefill"] >= 1 and kinds["decode"] >= 1

    # The timeline reads the same file (plain JSON), and the results alone.
    from aici_cli.report.timeline import read_results, read_trace

    bars, step_blocks = read_trace(tmp_path / "trace.jsonl")
    assert {b.index: b.reason for b in bars} == {
        i: r["finish_reason"] for i, r in results.items()}
    assert len(step_blocks) == summary["forward_passes"]
    ran = {i for i, r in results.items() if r["stats"]["forward_passes"]}
    assert {b.index for b in read_results(tmp_path / "out.jsonl")} == ran
    for png, extra in (("trace.png", ["--trace", str(tmp_path / "trace.jsonl")]),
                       ("results.png", [])):
        res = CliRunner().invoke(main, ["report", str(tmp_path / "out.jsonl"), "--timeline",
                                        str(tmp_path / png), *extra])
        assert res.exit_code == 0, res.output
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_guest_calls_are_spans_of_their_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    wasm = save(tmp_path, component(FORK_3, version="0.2.0"))
    lines = [json.dumps({"prompt": f"fork {i}", "max_tokens": 8}) for i in range(2)]
    code, results, summary = run(tiny_model_dir, tmp_path, lines, "--controller", str(wasm),
                                 "--trace", str(tmp_path / "trace.jsonl"))
    assert code == 0, results
    spans = parse_otlp_json(tmp_path / "trace.jsonl")
    line_spans = check_line_spans(spans, results)
    calls = 0
    for index, span in line_spans.items():
        assert len(results[index]["choices"]) == 3
        assert len(spans.children(span, "start")) == 1  # branches replay, not start
        assert len(spans.children(span, "fork replay")) == 2
        calls += len(spans.children(span, "mid-process"))
    assert calls == summary["guest_call_ms"]["calls"]


class Collector(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[bytes]]]:
    Collector.received = []
    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Collector.received
    server.shutdown()
    server.server_close()


def test_the_otlp_endpoint_variable_sends_spans_to_a_collector(
        tiny_model_dir: Path, tmp_path: Path, collector: tuple[str, list[bytes]]) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    endpoint, received = collector
    lines = [json.dumps({"prompt": f"hi {i}", "max_tokens": 4}) for i in range(3)]
    code, results, summary = run(tiny_model_dir, tmp_path, lines,
                                 env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert code == 0
    spans: list[Any] = []
    for body in received:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    got = Spans(spans)
    check_line_spans(got, results)
    assert len(got.named("step")) == summary["forward_passes"]
