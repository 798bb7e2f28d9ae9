"""External servers ddpmon runs for the user and the tests: Prometheus, Alertmanager, and the
scale-out path (VictoriaMetrics, vmagent shards, vmalert)."""

from ddpmon.services.alertmanager import Alertmanager, alertmanager_config
from ddpmon.services.process import ManagedProcess, StackError, find_binary, free_port
from ddpmon.services.prometheus import Prometheus, PrometheusAPI, prometheus_config
from ddpmon.services.scaleout import ScaleOut
from ddpmon.services.victoria import VictoriaMetrics, VMAgent, VMAlert, shard_scrape_config

__all__ = [
    "Alertmanager",
    "ManagedProcess",
    "Prometheus",
    "PrometheusAPI",
    "ScaleOut",
    "StackError",
    "VMAgent",
    "VMAlert",
    "VictoriaMetrics",
    "alertmanager_config",
    "find_binary",
    "free_port",
    "prometheus_config",
    "shard_scrape_config",
]
