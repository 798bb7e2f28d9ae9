#!/usr/bin/env bash
# Installs the Debian packages the tests and `make stack` use: promtool, prometheus, alertmanager,
# chromium (the headless browser that tests `ddpmon report`), iproute2 (`ip netns` for the
# two-node test), victoria-metrics (the store, vmagent and vmalert of the scale-out path,
# `make scaleout` and tests/scaleout) and Slurm (slurmctld, slurmd, slurmdbd, the client commands,
# munge and MariaDB for accounting: tests/slurm runs a controller, two nodes and `sacct`). Idempotent: exits at once when everything
# is there.
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null \
   && command -v prometheus-alertmanager >/dev/null && command -v chromium >/dev/null \
   && command -v ip >/dev/null && command -v victoria-metrics >/dev/null \
   && command -v vmagent >/dev/null && command -v vmalert >/dev/null \
   && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
   && command -v sbatch >/dev/null && command -v munged >/dev/null \
   && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager chromium \
  iproute2 victoria-metrics slurmctld slurmd slurmdbd slurm-client munge mariadb-server >/dev/null
# The packages enable system services; ddpmon starts its own instances on loopback instead, so
# stop and disable the packaged ones where an init system runs them (containers have none).
for unit in prometheus prometheus-alertmanager victoria-metrics slurmctld slurmd slurmdbd munge \
  mariadb; do
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now "$unit" >/dev/null 2>&1 || true
  elif [ -x "/etc/init.d/$unit" ]; then
    $SUDO "/etc/init.d/$unit" stop >/dev/null 2>&1 || true
  fi
done
