"""The monitoring mixin: alert rules, recording rules and dashboards generated from one config."""
