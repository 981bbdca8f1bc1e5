"""JUnit XML from results.json: one test case per check, skipped and error tasks as JUnit says them."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from evalsuite.reporting.junit import render_junit
from tests.documents import PPL_METRICS, results_document

PPL_RATIO = PPL_METRICS["ppl_ratio"]


def parse(results: dict[str, Any]) -> ET.Element:
    return ET.fromstring(render_junit(results).encode())


def counts(element: ET.Element) -> dict[str, str]:
    return {key: element.get(key) for key in ("tests", "failures", "errors", "skipped")}


def test_junit_parses_and_names_the_failed_check():
    root = parse(results_document())
    (failure,) = root.iter("failure")
    (case,) = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert case.get("classname") == "evalsuite.ppl" and case.get("name") == "ppl_ratio"
    assert failure.get("message") == "ppl_ratio: 1.81514 <= 1.7"
    assert repr(PPL_RATIO) in failure.text  # the body keeps full precision


def test_one_suite_per_task_and_one_testcase_per_check():
    root = parse(results_document())
    assert [s.get("name") for s in root.iter("testsuite")] == [
        "evalsuite.ppl",
        "evalsuite.vision",
        "evalsuite.tensors",
    ]
    ppl = root.find("testsuite[@name='evalsuite.ppl']")
    assert [c.get("name") for c in ppl.iter("testcase")] == ["ppl_ratio", "same_top_p"]
    assert counts(ppl) == {"tests": "2", "failures": "1", "errors": "0", "skipped": "0"}


def test_root_totals_count_tests_failures_errors_and_skipped():
    root = parse(results_document())
    assert root.tag == "testsuites"
    assert counts(root) == {"tests": "4", "failures": "1", "errors": "1", "skipped": "1"}


def test_skipped_task_is_one_skipped_testcase_with_its_reason():
    suite = parse(results_document()).find("testsuite[@name='evalsuite.vision']")
    (case,) = suite.iter("testcase")
    assert case.find("skipped").get("message") == "exllamav3 needs CUDA 12: no GPU on this machine"
    assert counts(suite) == {"tests": "1", "failures": "0", "errors": "0", "skipped": "1"}


def test_error_task_is_one_error_testcase_with_its_reason():
    suite = parse(results_document()).find("testsuite[@name='evalsuite.tensors']")
    (case,) = suite.iter("testcase")
    assert case.find("error").get("message") == "shard model-00003-of-00007.safetensors is truncated"
    assert counts(suite) == {"tests": "1", "failures": "0", "errors": "1", "skipped": "0"}


def test_metrics_are_suite_properties_as_json_writes_them():
    results = results_document()
    results["tasks"]["ppl"]["metrics"]["kld_is_estimate"] = True
    suite = parse(results).find("testsuite[@name='evalsuite.ppl']")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["kld_estimator"] == "top-k + sampled tail"
    assert props["ppl_ratio"] == repr(PPL_RATIO)
    assert props["kld_is_estimate"] == "true"


def test_passing_run_has_no_failures():
    results = results_document()
    for check in results["tasks"]["ppl"]["checks"]:
        check["passed"] = True
    results["tasks"] = {"ppl": {**results["tasks"]["ppl"], "status": "pass"}}
    root = parse(results)
    assert counts(root) == {"tests": "2", "failures": "0", "errors": "0", "skipped": "0"}
    assert root.find(".//failure") is None


def test_task_that_failed_without_checks_is_one_failed_testcase():
    root = parse(results_document(smoke={"status": "fail", "metrics": {}, "checks": []}))
    (case,) = root.iter("testcase")
    assert case.get("name") == "smoke" and case.find("failure") is not None
    assert counts(root) == {"tests": "1", "failures": "1", "errors": "0", "skipped": "0"}


def test_control_characters_in_a_reason_still_give_well_formed_xml():
    results = results_document(vision={"status": "error", "reason": "decoder said \x1b[31m<boom>\x00"})
    case = parse(results).find(".//error")
    assert "<boom>" in case.get("message")


def test_output_is_deterministic_and_has_no_timestamps():
    results = results_document()
    text = render_junit(results)
    assert text == render_junit(results)
    assert "timestamp" not in text and "hostname" not in text
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="evalsuite" tests="4"')
