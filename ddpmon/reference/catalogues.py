"""Reference pages built from the Python catalogues: metrics, attach options, event kinds and
run-dir files (with the history schema)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from .. import config, metrics
from ..recorder import event_kinds, history_schema
from ..rundir.catalogue import FILES
from .markdown import code, header, table


def metrics_page() -> str:
    out = [
        header(
            "Metrics",
            "`ddpmon/metrics/`",
            """
Every series a rank's `/metrics` endpoint exposes, by layer (the order of dashboard rows,
`ddpmon top` columns and alert groups). Every series also carries the labels
`run` and `rank`; the *labels* column lists only the extra ones. Counters end in `_total`;
a histogram's samples add `_bucket`, `_count` and `_sum`. With the default options a rank
exposes about 115 series (budget: 150). In code: `from ddpmon import metrics;
metrics.GRAD_NORM.name`.

The node daemon's own series (`ddpmon_node_*`, `ddpmon_daemon_*`) close the page; the daemon
serves the GPU series above too, without `run` and `rank` ([Daemon and gateway](../daemon.md)).
""",
        )
    ]
    for layer in metrics.Layer:
        rows = [
            (code(m.name), m.type.value, ", ".join(m.labels) or "", m.unit or "", m.help, m.when)
            for m in metrics.by_layer(layer)
        ]
        out.append(f"\n## {layer.value.capitalize()}\n\n")
        out.append(table(("metric", "type", "labels", "unit", "meaning", "present"), rows))
    rows = [
        (code(m.name), m.type.value, ", ".join(m.labels) or "", m.unit or "", m.help, m.when)
        for m in metrics.NODE_CATALOGUE
    ]
    out.append("\n## The node daemon's own series\n\nOne per node: no `run` or `rank` label.\n\n")
    out.append(table(("metric", "type", "labels", "unit", "meaning", "present"), rows))
    return "".join(out)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right after a field) of a dataclass, from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "none" if f.default is None else code(f.default)
    return "computed"


def config_page() -> str:
    docs = _field_docs(config.Config)
    rows = [
        (code(f.name), code(f.type), _default(f), code(config.ENV_PREFIX + f.name.upper()),
         docs.get(f.name, ""))
        for f in dataclasses.fields(config.Config)
        if f.name != "extra"
    ]
    return header(
        "Attach options",
        "`ddpmon/config.py` (`Config`)",
        f"""
Keyword arguments of `ddpmon.attach(model, optimizer, **options)` and of the Lightning and
Transformers callbacks, or `{config.ENV_PREFIX}<NAME>` environment variables (an argument wins
over the variable). Booleans in the environment take `1/0`, `true/false`, `yes/no`, `on/off`.
A bad value disables the agent with one message naming the option, the value and what is
allowed (`attach` returns a `NullMonitor` whose `error` says so); training continues. An
unknown option is an error that lists the known ones.

`on_nonfinite` takes {", ".join(code(c) for c in config.ON_NONFINITE_CHOICES)}.
""",
    ) + "\n" + table(("option", "type", "default", "environment", "meaning"), rows)


def events_page() -> str:
    out = [
        header(
            "Events",
            "`ddpmon/recorder/event_kinds.py`",
            """
Each rank appends one JSON object per line to `events.rank<R>.jsonl` in its run dir
(`run_dir/<run_id>/`). Lines are strict JSON (NaN and ±Inf are written as the strings `"nan"`,
`"inf"`, `"-inf"`); a torn last line is skipped by readers. A field may be absent when it does
not apply. *Failure* kinds are the ones `ddpmon timeline` can name as a run's first failure.

`ddpmon timeline` also shows rows it derives from other files: `signal` (from
`crash.rank<R>.txt`, or SIGTERM from `sigterm.rank<R>.txt`) and `vanished` (a rank with no
exit event or signal after its last event or progress update, e.g. SIGKILL).
""",
        ),
        "\n## Fields of every event\n\n",
        table(("field", "meaning"), [(code(k), v) for k, v in event_kinds.COMMON_FIELDS.items()]),
    ]
    for kind in event_kinds.EVENT_KINDS:
        out.append(f"\n## `{kind.name}`\n\n{kind.meaning}")
        out.append(" *Failure kind.*\n\n" if kind.failure else "\n\n")
        out.append(table(("field", "meaning"), [(code(k), v) for k, v in kind.fields.items()]))
    return "".join(out)


def files_page() -> str:
    rows = [(code(f.name), f.written, f.contents, f.read_by) for f in FILES]
    columns = [
        (code(name), arrow_type, history_schema.COLUMN_DOCS[name])
        for name, arrow_type in history_schema.SCALAR_COLUMNS
    ]
    columns.append(
        (code(history_schema.GROUPS_COLUMN), "fixed_size_list<float32>",
         history_schema.COLUMN_DOCS[history_schema.GROUPS_COLUMN])
    )
    skipped = ", ".join(f"{code(v)} {k or 'none'}" for k, v in history_schema.SKIPPED_CODES.items())
    return (
        header(
            "Run-dir files",
            "`ddpmon/rundir/catalogue.py` and `ddpmon/recorder/history_schema.py`",
            """
Every rank writes its story to `run_dir/<run_id>/` (`run_dir` option, default
`ddpmon-runs`). Each name is defined once, in `ddpmon/rundir/layout.py`; every file other than the
append-only logs is written atomically (temp file, fsync, rename) through `ddpmon/rundir/atomic.py`,
so a reader sees a whole file or none. What the files mean for a post-mortem is in
[Forensics](../forensics/index.md).
""",
        )
        + "\n"
        + table(("file", "written", "contents", "read by"), rows)
        + "\n## The history schema\n\n"
        "`history.rank<R>.arrow` is an Arrow IPC *stream* (zstd), one row per optimizer step, "
        "readable by any Arrow reader (`pyarrow.ipc.open_stream`, polars, DuckDB). How it is "
        "written and bounded: [The numerics history](../forensics/history.md).\n\n"
        + table(("column", "Arrow type", "meaning"), columns)
        + f"\n`skipped_by` codes: {skipped}.\n"
    )
