#!/usr/bin/env bash
# Installs the Debian packages the tests and `make stack` use: promtool, prometheus, alertmanager,
# chromium (the headless browser that tests `ddpmon report`), iproute2 (`ip netns` for the
# two-node test) and victoria-metrics (the store, vmagent and vmalert of the scale-out path and
# the 16k-rank benchmark).
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null \
   && command -v prometheus-alertmanager >/dev/null && command -v chromium >/dev/null \
   && command -v ip >/dev/null && command -v victoria-metrics >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager chromium \
  iproute2 victoria-metrics >/dev/null
# The packages enable system services; ddpmon starts its own instances on loopback instead.
