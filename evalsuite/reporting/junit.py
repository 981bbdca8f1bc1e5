"""JUnit XML from results.json alone, for CI systems that show test results (one test case per check).

Each task is a `<testsuite name="evalsuite.TASK">` and each of its checks a `<testcase>`; a failed check
carries a `<failure>`, a skipped task one `<skipped>` test case and a task that could not run one `<error>`
test case, so a CI dashboard tells a regression (exit 1) from a run that could not be done (exit 2) the way
evalsuite does.
The output depends on the document only: no timestamps, no host name, attributes in a fixed order.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from evalsuite.reporting.diff_report import checked_name, format_number

# XML 1.0 cannot carry most control characters, even escaped; a reason quoting a tool's output might.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_COUNTS = ("tests", "failures", "errors", "skipped")


def _text(value: Any) -> str:
    """An attribute or text value: JSON scalars as JSON writes them, illegal XML characters replaced."""
    if isinstance(value, bool) or value is None:
        value = "null" if value is None else str(value).lower()
    return _NOT_XML.sub("\ufffd", str(value))


def failure_message(check: dict[str, Any]) -> str:
    """`NAME: value OP threshold`: the condition the check required, numbers as the report shows them."""
    value, threshold = format_number(check["value"], 6), format_number(check["threshold"], 6)
    return f"{checked_name(check)}: {value} {check['op']} {threshold}"


def _add_testcase(suite: ET.Element, task: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", {"classname": f"evalsuite.{task}", "name": _text(name)})


def _task_suite(root: ET.Element, task: str, entry: dict[str, Any]) -> dict[str, int]:
    """Append the task's `<testsuite>` to `root`; returns its counts."""
    # The counts are placeholders filled at the end: created now so they follow `name` in attribute order.
    suite = ET.SubElement(root, "testsuite", {"name": f"evalsuite.{task}", **dict.fromkeys(_COUNTS, "0")})
    counts = dict.fromkeys(_COUNTS, 0)
    metrics = entry.get("metrics", {})
    if metrics:
        properties = ET.SubElement(suite, "properties")
        for name, value in metrics.items():
            ET.SubElement(properties, "property", {"name": _text(name), "value": _text(value)})
    status, reason = entry["status"], _text(entry.get("reason") or entry["status"])
    checks = entry.get("checks", [])
    if status in ("skipped", "error"):
        # `skipped` and `error` are the JUnit words for exactly these two statuses.
        ET.SubElement(_add_testcase(suite, task, task), status, {"message": reason})
        counts.update(tests=1, **{"skipped" if status == "skipped" else "errors": 1})
    elif not checks:
        # A task that ran without checks is still one test case, failed if the task says so.
        case = _add_testcase(suite, task, task)
        counts["tests"] = 1
        if status == "fail":
            ET.SubElement(case, "failure", {"message": reason})
            counts["failures"] = 1
    else:
        for check in checks:
            case = _add_testcase(suite, task, check["name"])
            counts["tests"] += 1
            if not check["passed"]:
                failure = ET.SubElement(case, "failure", {"message": _text(failure_message(check))})
                # Full precision in the body: the message rounds to 6 significant digits.
                failure.text = _text(
                    f"value {check['value']!r}, required {check['name']} {check['op']} {check['threshold']!r}"
                )
                counts["failures"] += 1
    for key in _COUNTS:
        suite.set(key, str(counts[key]))
    return counts


def render_junit(results: dict[str, Any]) -> str:
    """JUnit XML for a results.json document.

    Args:
        results: a results.json document (schema `evalsuite.results/1`).

    Returns:
        The XML text: a `<testsuites>` root with the totals, one `<testsuite name="evalsuite.TASK">` per task
        (its metrics as `<properties>`), one `<testcase>` per check.
    """
    root = ET.Element("testsuites", {"name": "evalsuite", **dict.fromkeys(_COUNTS, "0")})
    totals = dict.fromkeys(_COUNTS, 0)
    for task, entry in results["tasks"].items():
        for key, count in _task_suite(root, task, entry).items():
            totals[key] += count
    for key in _COUNTS:
        root.set(key, str(totals[key]))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
