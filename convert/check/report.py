"""The report of `convert-dsv4 check`: one result per check, as text, JSON or JUnit XML (one
test case per check, so GitHub Actions and GitLab show each one). The checks themselves are
in convert/check/run.py, the command in convert/cli/main.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsv4.convert.errors import CheckError, OutputError

Status = Literal["pass", "fail", "skip"]


@dataclass
class CheckResult:
    name: str
    status: Status
    reason: str
    exit_code: int = 0
    error: CheckError | None = field(default=None, repr=False)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
        }
        if self.error is not None:
            out["exit_code"] = self.exit_code
            out["error"] = type(self.error).__name__
            out.update(self.error.fields())
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class CheckReport:
    checkpoint: str
    results: list[CheckResult]
    drafter_family: str | None = None  # the drafter family the checkpoint holds (mapping/drafters.py)
    drafter: list[str] = field(default_factory=list)  # what the report says of it (convert/launch.py)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        """The first failed check's code (checks run in a fixed order), 0 when all passed."""
        return self.failures[0].exit_code if self.failures else 0

    def result(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in ("pass", "fail", "skip")}
        verdict = "OK" if self.ok else f"FAILED (exit {self.exit_code})"
        return (
            f"{self.checkpoint}: {verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
        )

    def raise_for_failure(self) -> None:
        """Raise the first failed check's error (its one-line reason and exit code)."""
        for r in self.failures:
            assert r.error is not None
            raise r.error

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "summary": self.summary(),
            "drafter_family": self.drafter_family,
            "drafter": self.drafter,
            "checks": [r.to_json() for r in self.results],
        }

    def to_junit(self) -> str:
        """JUnit XML: one test case per check; a failure carries the reason, a skip its why."""
        total = sum(r.seconds for r in self.results)
        counts = {
            "tests": str(len(self.results)),
            "failures": str(len(self.failures)),
            "errors": "0",
            "skipped": str(sum(r.status == "skip" for r in self.results)),
            "time": f"{total:.3f}",
        }
        suites = ET.Element("testsuites", {"name": "convert-dsv4 check", **counts})
        suite = ET.SubElement(suites, "testsuite", {"name": f"convert-dsv4 check {self.checkpoint}", **counts})
        for r in self.results:
            case = ET.SubElement(
                suite, "testcase", {"classname": "convert-dsv4.check", "name": r.name, "time": f"{r.seconds:.3f}"}
            )
            if r.status == "fail":
                failure = ET.SubElement(case, "failure", {"message": r.reason, "type": r.error.kind})
                failure.text = f"{r.reason} (exit code {r.exit_code})"
            elif r.status == "skip":
                ET.SubElement(case, "skipped", {"message": r.reason})
            else:
                ET.SubElement(case, "system-out").text = r.reason
        ET.indent(suites)
        return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(report: CheckReport, path: Path) -> None:
    """Write the report as JUnit XML to `path`, creating its directory (CI often names a
    fresh reports/ folder). A file that cannot be written is a write_failed (exit 42)
    whose one line also carries the checks' verdict."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.to_junit())
    except OSError as exc:
        # mkdir says "File exists" when the folder's name is taken by a file
        why = (
            f"{path.parent} is not a directory"
            if isinstance(exc, FileExistsError)
            else exc.strerror or str(exc).splitlines()[0]
        )
        verdict = (
            "all checks passed"
            if report.ok
            else f"the checks FAILED (exit {report.exit_code}: {report.failures[0].name})"
        )
        raise OutputError(
            f"{path}: cannot write the JUnit report ({why}); {verdict}", kind="write_failed", path=str(path)
        ) from None
