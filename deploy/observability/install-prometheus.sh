#!/bin/sh
# Installs Debian's Prometheus server (with promtool) when it is missing; the
# Prometheus integration test runs this. Needs root and the Debian archive.
set -e
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a service where systemd runs; the tests start their own.
