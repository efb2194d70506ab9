"""`aici-batch report --junit FILE`: one JUnit test case per result line, for the test
views of GitLab, Jenkins and GitHub.

The layout is the one those readers share (Jenkins' JUnit schema): one `<testsuite>` in
a `<testsuites>` root; a case per line, named by its id, failed (`<failure>`) when its
answer is wrong or its JSON invalid, in error (`<error>`) when the line ended in an
error; its answer and the expected one in the failure message and in `<system-out>`.
Written with the standard library's ElementTree, which escapes what XML cannot hold.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from aici_cli.core.errors import ReportError
from aici_cli.report.lines import LineOutcome

# Characters XML 1.0 cannot hold at all, even escaped (a model may write them).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def _show(text: str | None, limit: int = 200) -> str:
    if text is None:
        return "(none)"
    shown = text if len(text) <= limit else text[:limit] + "..."
    return repr(shown)


def junit_tree(lines: Sequence[LineOutcome], suite: str) -> ET.ElementTree:
    failures = sum(line.status in ("wrong", "invalid") for line in lines)
    errors = sum(line.status == "error" for line in lines)
    seconds = sum(line.seconds for line in lines)
    root = ET.Element("testsuites", name="aici-batch", tests=str(len(lines)),
                      failures=str(failures), errors=str(errors), time=f"{seconds:.3f}")
    suite_el = ET.SubElement(root, "testsuite", name=suite, tests=str(len(lines)),
                             failures=str(failures), errors=str(errors), skipped="0",
                             time=f"{seconds:.3f}")
    for line in lines:
        case = ET.SubElement(suite_el, "testcase", name=_clean(line.name), classname=suite,
                             time=f"{line.seconds:.3f}")
        status = line.status
        if status == "error":
            assert line.error is not None
            etype, message = line.error
            el = ET.SubElement(case, "error", type=etype, message=_clean(message))
            el.text = _clean(message)
        elif status in ("wrong", "invalid"):
            what = ("wrong answer" if status == "wrong"
                    else "output does not validate against its JSON schema")
            message = f"{what}: answered {_show(line.text)}, expected {_show(line.answer)}"
            el = ET.SubElement(case, "failure", type=status, message=_clean(message))
            el.text = _clean(message)
        out = ET.SubElement(case, "system-out")
        out.text = _clean(f"id: {line.name}\nline: {line.index}\nanswer: {line.text}\n"
                          f"expected: {line.answer if line.answer is not None else '(none)'}")
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(path: str | Path, lines: Sequence[LineOutcome], suite: str) -> None:
    try:
        junit_tree(lines, suite).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as e:
        raise ReportError(f"--junit {path}: cannot write it: {e.strerror or e}") from None
