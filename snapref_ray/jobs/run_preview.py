"""What a job would do, found without doing it: `snapref-ray render --dry-run`, and the reason a job that can
render nothing gives before it starts Ray.

The same steps as the start of `run_job` (snapref_ray/jobs/generate_dataset.py), each read-only: the adapter kind and
the manifest validated row by row (references read and hashed: `validate_manifest`, the run's own first phase), whether
the output is new, this job's (a resume) or another job's (which needs `--append`), and which items are already
committed there. Nothing is written: a local output folder that does not exist is not created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from snapref_ray.job_spec import JobSpec, JobSpecError
from snapref_ray.jobs.job_settings import OutputPlace
from snapref_ray.jobs.manifest_check import ManifestSettings, RowError
from snapref_ray.jobs.spilled_items import SpilledItems, plan_against_output
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.loading import adapter_kind, check_named_files
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.item_contents import read_committed_state


class NothingToRender(ValueError):
    """Every row of the manifest is invalid: the job would render nothing (a usage error, exit status 2)."""


@dataclass(frozen=True)
class RunPreview:
    """A job's work, as validation and the output's ledger see it before anything runs."""

    manifest: str
    output: str
    rows: int  # manifest rows read
    items: int  # images the valid rows ask for
    errors: list[RowError]  # why rows are invalid (a row may have several); the first 1,000 of them
    invalid_rows_count: int  # rows with an error
    committed: int  # items already in the output's metadata (a resume skips them)
    owner: str  # "new", "this job", "appended" (append asked for) or "another job"

    @property
    def invalid_rows(self) -> int:
        return self.invalid_rows_count

    @property
    def to_render(self) -> int:
        return self.items - self.committed

    def lines(self) -> list[str]:
        """The plan as a person reads it: one line of counts, the output's state, then one line per invalid row."""
        out = [
            f"{self.rows} manifest row(s) -> {self.items} item(s) ({self.invalid_rows} invalid row(s)); "
            f"{self.committed} already committed, {self.to_render} to render",
            f"output {self.output}: {_OWNER_TEXT[self.owner]}",
        ]
        out += [f"invalid: {error}" for error in self.errors[:20]]
        if len(self.errors) > 20:
            out.append(f"invalid: ... and {len(self.errors) - 20} more")
        return out


_OWNER_TEXT = {
    "new": "new (nothing there yet)",
    "this job": "this job's: a run resumes it",
    "appended": "another job's; --append adds this job's images to it",
    "another job": "another job's: add --append to add this job's images to it, or choose another --out",
}


def validate_manifest(manifest: ManifestSettings, model: ModelSpec, *, progress: bool = False) -> SpilledItems:
    """Every row of the manifest validated for the kind of the job's reference adapter, the valid items spilled to
    local disk (jobs/spilled_items.py): a run's first phase, and what a dry run counts. A job without a reference
    adapter is refused (every item reads a reference)."""
    check_named_files(model, s3=manifest.s3)  # a missing LoRA: one line here, not four workers failing to start
    kind = adapter_kind(model, s3=manifest.s3)
    if kind is None:
        raise JobSpecError(
            "no reference adapter: set model.adapter in the job spec (--adapter), or put adapter.safetensors in"
            f" the models folder ({model.models_dir})"
        )
    return SpilledItems.build(manifest, adapter_kind=kind, progress=progress)


def preview_run(spec: JobSpec) -> RunPreview:
    """Validate `spec` and read its output's ledger, writing nothing."""
    manifest = ManifestSettings.of(spec)
    output = OutputPlace.of(spec, s3=manifest.s3)
    with validate_manifest(manifest, spec.model) as plan:
        owner, committed = _output_state(output, plan)
        return RunPreview(
            manifest=manifest.manifest,
            output=output.uri,
            rows=plan.rows,
            items=plan.items,
            errors=list(plan.errors_head),
            invalid_rows_count=plan.invalid_rows,
            committed=committed,
            owner=owner,
        )


def _output_state(output: OutputPlace, plan: SpilledItems) -> tuple[str, int]:
    """Who owns the output, and how many of the plan's items it holds already (marked in the plan)."""
    if not _output_exists(output.uri):
        return "new", plan.committed
    committed = read_committed_state(open_storage(output.uri, output.s3), output.fingerprint)
    owner = committed.owner(output.fingerprint, append=output.settings.append)
    if owner in ("this job", "appended"):  # what the run would refuse, refused here the same way
        plan_against_output(plan, committed, rerender_changed=output.rerender_changed)
    else:
        plan.skip_committed(committed.ids)
    return owner, plan.committed


def check_something_to_render(manifest: str, validated: SpilledItems | RunPreview) -> None:
    """NothingToRender when the manifest has rows and none of them is valid, naming the first row's reasons."""
    errors, rows, items = validated.errors, validated.rows, validated.items
    if items or not errors:
        return
    raise NothingToRender(nothing_to_render_message(manifest, rows, errors))


def nothing_to_render_message(manifest: str, rows: int, errors: list[RowError]) -> str:
    """`every row of M is invalid (N rows), nothing rendered; row 1, field 'x': ...` on one line."""
    first_row = errors[0].manifest_row
    first = "; ".join(str(e) for e in errors if e.manifest_row == first_row)
    return f"every row of {manifest} is invalid ({rows} row(s)), nothing rendered; {first}"


def _output_exists(uri: str) -> bool:
    """Whether the output may hold anything: an s3:// prefix is read; a local folder must exist (opening it would
    create it)."""
    if uri.startswith("s3://"):
        return True
    return os.path.isdir(os.path.expanduser(uri.removeprefix("file://")))
