"""External servers ddpmon runs for the user and the tests: Prometheus and Alertmanager."""

from ddpmon.services.alertmanager import Alertmanager, alertmanager_config
from ddpmon.services.process import ManagedProcess, StackError, find_binary, free_port
from ddpmon.services.prometheus import Prometheus, PrometheusAPI, prometheus_config

__all__ = [
    "Alertmanager",
    "ManagedProcess",
    "Prometheus",
    "PrometheusAPI",
    "StackError",
    "alertmanager_config",
    "find_binary",
    "free_port",
    "prometheus_config",
]
