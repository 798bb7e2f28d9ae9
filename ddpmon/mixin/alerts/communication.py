"""Communication alerts: hangs, lost ranks, ranks that drift apart, stragglers, slow collectives.

One killed rank makes its peers hang in the next collective: RankDown (the cause) pages, and
Alertmanager inhibits the run's TrainingStalled, RankDesync, Straggler and CollectiveSlow. Stall
and slow collectives are run-wide symptoms: one alert per run (and op) naming the worst ranks.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin import stragglers
from ddpmon.mixin.alerts import RANK, RUN, Alert, rank_list
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.COMMUNICATION
BY_RUN = 'run="%s"'
BY_RUN_OP = 'run="%s",op="%s"'


def alerts(c: MixinConfig) -> list[Alert]:
    gw = c.gauge_window

    def stepped(run: str = "") -> str:
        return f"max_over_time({sel(c, m.STEPS.name, run)}[{gw}])"

    def stalled(run: str = "") -> str:
        r = f"{{{run}}}" if run else ""
        return f"{n.HEARTBEAT_AGE}{r} > {n.STALL_THRESHOLD}{r}\nand {stepped(run)} > 0"

    def no_first_step(run: str = "") -> str:
        r = f"{{{run}}}" if run else ""
        return f"{n.HEARTBEAT_AGE}{r} > {c.first_step_seconds:g}\nand {stepped(run)} == 0"

    def slow(match: str = "") -> str:
        mean = f"{n.COLLECTIVE_MEAN}{{{match}}}" if match else n.COLLECTIVE_MEAN
        return (
            f"{mean}\n>\n{c.collective_slow_factor:g} * quantile_over_time(0.5, "
            f"{mean}[{c.collective_slow_baseline}])\nand\n{mean} > "
            f"{c.collective_slow_min_seconds:g}"
        )

    missing = (
        f"group by (rank) (last_over_time({sel(c, m.WORLD_SIZE.name, BY_RUN)}"
        f"[{c.missing_lookback}])) unless on (rank) "
        f"group by (rank) ({sel(c, m.WORLD_SIZE.name, BY_RUN)})"
    )
    return [
        Alert(
            "DdpmonTrainingStalled", L, "critical",
            # The agent exports its stall_seconds (rank:...:stall_threshold falls back to the
            # config's where it does not); only after a first step (see NoFirstStep).
            f"max {c.by_run} (\n{stalled()}\n)",
            c.stall_for,
            "Training has not completed a step for too long; it is probably hung.",
            f"{RUN} has not completed a step for {{{{ $value | humanizeDuration }}}} on its "
            "most stalled rank, past the agent's stall threshold. Stalled ranks, oldest first: "
            f"{rank_list(stalled(BY_RUN), c)}.",
        ),
        Alert(
            "DdpmonNoFirstStep", L, "warning",
            f"max {c.by_run} (\n{no_first_step()}\n)",
            c.first_step_for,
            "A rank attached ddpmon long ago and has not completed a step.",
            f"{RUN}: a rank attached {{{{ $value | humanizeDuration }}}} ago and has not "
            "completed a step yet (stuck in initialisation, rendezvous, compilation or the "
            "first collective). Ranks without a step, longest waiting first: "
            f"{rank_list(no_first_step(BY_RUN), c)}.",
        ),
        Alert(
            "DdpmonRankDown", L, "critical",
            f"{sel(c, 'up')} == 0",
            c.rank_down_for,
            "A training rank cannot be scraped.",
            f"{RANK} ({{{{ $labels.instance }}}}) cannot be scraped: the process died, hung "
            "hard or is unreachable.",
        ),
        Alert(
            "DdpmonRanksMissing", L, "critical",
            f"{n.WORLD_SIZE} - {n.RANKS_REPORTING} > 0",
            c.ranks_missing_for,
            "Fewer ranks report than the run's world size.",
            f"{RUN}: {{{{ $value }}}} rank(s) of its world size are not reporting. "
            f"Ranks seen in the last {c.missing_lookback} that stopped: "
            f"{rank_list(missing, c, worst_first=False)}.",
        ),
        Alert(
            "DdpmonRankDesync", L, "warning",
            f"{n.STEP_LEADER}\n- {c.on_run} group_right\n"
            f"{sel(c, m.STEP.name)}\n> {c.rank_desync_steps:g}",
            c.rank_desync_for,
            "Ranks of a run are at very different steps.",
            f"{RANK} is {{{{ $value }}}} steps behind the most advanced rank of the run.",
        ),
        stragglers.alert(c),
        Alert(
            "DdpmonCollectiveSlow", L, "warning",
            f"max by ({', '.join(c.run_labels)}, op) (\n{slow()}\n)",
            c.collective_slow_for,
            "A collective's latency is far above its baseline.",
            f"{RUN}: mean {{{{ $labels.op }}}} time reached {{{{ $value | humanizeDuration }}}}, "
            f"more than {c.collective_slow_factor:g}x its {c.collective_slow_baseline} median. "
            f"Slowest ranks: {rank_list(slow(BY_RUN_OP), c, fill=('run', 'op'))}.",
        ),
    ]
