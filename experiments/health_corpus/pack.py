"""A compact, committed copy of the labelled corpus: enough to rescore it without the run directories.

``pack_corpus(runs, path)`` writes one gzipped JSON object: per run its label and its doctor records trimmed to
what the checks read: the per-step metrics whose names :func:`kept_metric` keeps (not the per-feature MEI
copies, timings or throughput), the events the checks read (:data:`EVENTS_READ`), the held-out eval records,
the settings the checks use (``RunRecords.config``) and the logged completions with only the fields the checks
read (:data:`SAMPLE_FIELDS`). ``unpack_corpus(path)`` gives the runs back; :func:`verify_trimmed` checks that
the doctor's verdict on a trimmed run is the one on the full records.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from experiments.health_corpus.corpus import CorpusRun, _unique, check_label
from meshrl.doctor.diagnose import diagnose_records
from meshrl.doctor.records import RunRecords

FORMAT = "meshrl-health-corpus"
VERSION = 1
#: metric-name prefixes (or whole names) the checks and the raw signals read
KEPT_PREFIXES = ("reward/", "entropy/", "len/", "kl/", "ratio/", "clip/", "grad/", "skipped/", "group/", "adv/",
                 "rollouts/", "mismatch/", "eval/", "mei/query", "mei/directions", "mei/effective_dirs",
                 "mei/g_over_mei", "strategy/max_mass", "strategy/problem_max_mass")
KEPT_NAMES = ("step", "lr", "acc/mean", "loss/total", "loss/policy")
EVENTS_READ = ("mei_first_crossing", "nonfinite_skip", "nonfinite_abort")
SAMPLE_FIELDS = ("step", "completion", "score", "reward", "truncated")


def kept_metric(key: str) -> bool:
    return key in KEPT_NAMES or key.startswith(KEPT_PREFIXES)


def _json_number(v: Any) -> Any:
    """NaN / inf as the strings the trainer writes (JSON has neither; ``number`` reads them back)."""
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return v


def _rows(rows: list[dict[str, Any]], keep) -> list[dict[str, Any]]:
    return [{k: _json_number(v) for k, v in r.items() if keep(k)} for r in rows]


def trimmed(run: CorpusRun) -> dict[str, Any]:
    rec = run.records
    return {"label": run.label, "engine": rec.engine, "config": rec.config, "notes": rec.notes,
            "steps": _rows(rec.steps, kept_metric),
            "events": [e for e in rec.events if e.get("event") in EVENTS_READ],
            "evals": _rows(rec.evals, lambda k: k == "step" or k.startswith("eval/")),
            "samples": _rows(rec.samples, lambda k: k in SAMPLE_FIELDS)}


def _records(entry: dict[str, Any], where: str) -> RunRecords:
    from meshrl.doctor.records import number

    def numeric(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
        return [{k: f for k, v in r.items() if (f := number(v)) is not None} for r in rows]

    return RunRecords(path=Path(where), engine=entry["engine"], steps=numeric(entry["steps"]),
                      samples=entry["samples"], events=entry["events"], evals=numeric(entry["evals"]),
                      config=entry["config"], notes=list(entry["notes"]))


def pack_corpus(runs: list[CorpusRun], path: Path, settings: dict[str, Any] | None = None) -> dict[str, int]:
    """Write ``path`` (gzipped JSON, deterministic: sorted by run id, gzip without a timestamp)."""
    data = {"format": FORMAT, "version": VERSION, "settings": settings or {},
            "runs": [trimmed(r) for r in sorted(runs, key=lambda r: r.id)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(data, sort_keys=True).encode()
    with path.open("wb") as fh, gzip.GzipFile(filename="", fileobj=fh, mode="wb", mtime=0) as gz:
        gz.write(raw)
    return {"runs": len(runs), "bytes": path.stat().st_size}


def unpack_corpus(path: Path) -> tuple[list[CorpusRun], dict[str, Any]]:
    """The runs of a pack and its settings; ``ValueError`` naming the file and entry when it is not one."""
    with gzip.open(path, "rt") as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} pack (no 'format': {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: pack version {data.get('version')!r}, this reader knows {VERSION}")
    runs = []
    for i, entry in enumerate(data["runs"]):
        where = f"{path} runs[{i}]"
        missing = [k for k in ("label", "engine", "config", "notes", "steps", "events", "evals", "samples")
                   if k not in entry]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
        label = check_label(entry["label"], where)
        runs.append(CorpusRun(label, _records(entry, f"{path}#{label['id']}")))
    return _unique(runs), data.get("settings", {})


def verify_trimmed(full: list[CorpusRun], packed: list[CorpusRun]) -> list[str]:
    """Runs whose doctor verdict (finding ids and severities, unchecked ids) on the whole trimmed records differs
    from the one on the full records: empty when the trimming kept everything the checks read."""
    by_id = {r.id: r for r in packed}
    bad = []
    for run in full:
        a, b = diagnose_records(run.records), diagnose_records(by_id[run.id].records)
        if [(f.id, f.severity) for f in a.findings] != [(f.id, f.severity) for f in b.findings] or \
                [u.id for u in a.unchecked] != [u.id for u in b.unchecked]:
            bad.append(run.id)
    return bad
