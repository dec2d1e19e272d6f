"""Task glue of the check-data component: spec text in, report files out."""

from __future__ import annotations

import json
from pathlib import Path

from tailguard.core.taskio import task_entry


@task_entry("check-data")
def main(*, spec_yaml: str, report_dir: str) -> str:
    """Run the Great Expectations suite; write data_check.json into `report_dir` (also when it fails).

    Raises:
        DataCheckError: an expectation failed (exit 1). InputError: a data file is missing (exit 2).
    """
    from tailguard.components.check_data.logic import check_datasets, write_report
    from tailguard.core.errors import DataCheckError
    from tailguard.core.spec import spec_from_yaml

    spec = spec_from_yaml(spec_yaml)
    Path(report_dir).mkdir(parents=True, exist_ok=True)
    try:
        report = check_datasets(spec)
    except DataCheckError as err:
        write_report(err.report, Path(report_dir))  # a failed check leaves its evidence
        raise
    write_report(report, Path(report_dir))
    return json.dumps(report.to_dict(), default=str)
