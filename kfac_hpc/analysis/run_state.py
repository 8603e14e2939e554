"""The state of a run's row in the runs table: the point's state (the contract's classifier)
as a row state, after the checks that the run directory's files agree with each other."""

from __future__ import annotations

from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.contracts.rundir import Marker, Markers
from kfac_hpc.contracts.states import ENDED_BADLY, PointState, Verdict, classify_point

__all__ = ["row_state"]


def _manifest_verdict(manifest: dict[str, Any]) -> Verdict:
    """The manifest's last known state of the point; without a manifest, a run dir with no
    end marker may still be running (nothing here can ask its scheduler)."""
    raw = str(manifest.get("state") or "")
    try:
        state = PointState(raw)
    except ValueError:
        return Verdict(
            PointState.RUNNING,
            "no done/error marker: still running, or killed before it could write one",
        )
    detail = str(manifest.get("detail") or "")[:200]
    text = f"job {raw} (manifest)" + (", no done marker" * (state in ENDED_BADLY))
    return Verdict(state, text + (f": {detail}" if detail and state in ENDED_BADLY else ""))


def row_state(
    markers: Markers, summary: dict[str, Any], manifest: dict[str, Any]
) -> tuple[str, str]:
    """(row state, reason) of a run from its markers, run.json (``summary``) and its manifest
    point (``manifest``, empty without one)."""
    summary_state = summary.get("state")
    if markers.done is not None and markers.error is not None:
        return schema.INVALID, "both done and error markers present"
    if markers.error is None and summary_state == str(Marker.ERROR):
        markers = markers._replace(error=str(summary.get("error") or ""))
    if markers.preempted is None and summary_state == str(Marker.PREEMPTED):
        markers = markers._replace(preempted="")
    known = _manifest_verdict(manifest)
    verdict = classify_point(markers, known)
    if markers.error is not None:  # run.json may say error where no marker is left
        return schema.FAILED, f"error: {markers.error or 'no message'}"
    if markers.done is not None:
        if not summary:
            return schema.INVALID, "done marker but run.json missing or unreadable"
        if summary_state != str(Marker.DONE):
            return schema.INVALID, f"done marker but run.json says state {summary_state!r}"
        return schema.DONE, ""
    if verdict.state is PointState.DONE:
        return schema.INVALID, "manifest says done but no done marker"
    if verdict is known:
        return schema.ROW_STATE[verdict.state], known.detail
    return schema.ROW_STATE[verdict.state], "preempted, waiting for requeue"
