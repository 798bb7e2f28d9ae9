"""The hang alert: the rank(s) the others wait for, named while the job is alive.

Each rank exports the collectives it has issued per process group, the collective it has in
flight once it made no progress for a second, and, once it made none for its ``hang_seconds``,
where it is stuck (``ddpmon_stuck_seconds{phase, frame, quiet}``). The ranks with a collective
in flight *wait*; the group most of them wait on,
and the highest sequence number they wait in, is the hung collective; a rank whose last issued
sequence number on that group is below it never entered it: the others wait for it. One alert
per such rank (a cause on one rank), with its phase and innermost user frame as labels; none
while it is in a quiet phase (a checkpoint, before its first step, a ``mon.phase()``). The
same rule, in Python, is ``ddpmon.daemon.hang_naming`` (``ddpmon top``).
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin.alerts import RANK, Alert, rank_list
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel


def waiting(c: MixinConfig, extra: str = "") -> str:
    """Ranks waiting in a collective (value: its sequence number). The agent exports the
    collective in flight only after a second without progress, so no join with the stuck
    series is needed here: at 16,384 ranks that join doubled the rule's time."""
    return sel(c, m.COLLECTIVE_INFLIGHT_SEQUENCE.name, extra)


def waited_for(c: MixinConfig) -> str:
    """Per run, the hung group's collective: the highest sequence number stuck ranks wait in,
    on the group most of them wait on."""
    by = ", ".join(c.run_labels)
    busiest = f"topk by ({by}) (1, count by ({by}, group) (\n{waiting(c)}\n))"
    return f"max by ({by}, group) (\n{waiting(c)}\n)\nand on ({by}, group)\n{busiest}"


def holders(c: MixinConfig) -> str:
    """Ranks behind the hung collective on its group, stuck outside a quiet phase, with their
    phase and frame (value: the rank's last issued sequence number there). The holder must be
stuck past its ``hang_seconds``, so the others have waited that long too."""
    by = ", ".join(c.run_labels)
    loud = sel(c, m.STUCK.name, 'quiet="0"')
    return (
        f"(\n{sel(c, m.COLLECTIVE_SEQUENCE.name)}\n< on ({by}, group) group_left ()\n"
        f"(\n{waited_for(c)}\n)\n)\n"
        f"+ on ({by}, rank) group_left (phase, frame)\n(0 * {loud})"
    )


def mismatched(c: MixinConfig) -> str:
    """Ranks in the hung collective's sequence number whose op is not the one most of them are
    in (every rank entered it, so no holder is behind): with their phase and frame (value: the
    sequence number). A tie names none."""
    by = ", ".join(c.run_labels)
    at_seq = f"(\n{waiting(c)}\n== on ({by}, group) group_left ()\n(\n{waited_for(c)}\n)\n)"
    per_op = f"count by ({by}, group, op) {at_seq}"
    minority = (f"{per_op}\n< on ({by}, group) group_left ()\n"
                f"max by ({by}, group) ({per_op})")
    loud = sel(c, m.STUCK.name, 'quiet="0"')
    return (f"(\n{at_seq}\nand on ({by}, group, op)\n(\n{minority}\n)\n)\n"
            f"+ on ({by}, rank) group_left (phase, frame)\n(0 * {loud})")


def alerts(c: MixinConfig) -> list[Alert]:
    in_group = waiting(c, 'run="%s",group="%s"').replace("\n", " ")
    args = "$labels.run $labels.group"
    collective = (
        f"{{{{ range query (printf `topk(1, count by (op) ({in_group}))` {args}) }}}}"
        f"{{{{ .Labels.op }}}}{{{{ end }}}} #{{{{ range query (printf `max({in_group})` {args}) "
        "}}{{ .Value }}{{ end }}"
    )
    ranks = rank_list(in_group, c, worst_first=False, fill=("run", "group"))
    return [
        Alert(
            "DdpmonHangHolder", Layer.COMMUNICATION, "critical",
            holders(c),
            c.hang_for,
            "The other ranks of a run wait in a collective this rank never entered.",
            f"{RANK} holds the run: the other ranks wait in {collective} on process group "
            "{{ $labels.group }}, which it has not entered (its last collective there is #"
            "{{ $value }}). It is in phase {{ $labels.phase }}, at {{ $labels.frame }}. "
            f"Ranks waiting: {ranks}.",
        ),
        Alert(
            "DdpmonCollectiveMismatch", Layer.COMMUNICATION, "critical",
            mismatched(c),
            c.hang_for,
            "Every rank entered the hung collective, this one with another op than the others.",
            f"{RANK} waits in {{{{ $labels.op }}}} #{{{{ $value }}}} on process group "
            "{{ $labels.group }}, where most ranks wait in "
            f"{collective.rpartition(' #')[0]}: the ranks called different collectives at the "
            "same sequence number, and none can complete. It is in phase {{ $labels.phase }}, "
            "at {{ $labels.frame }}.",
        ),
    ]
