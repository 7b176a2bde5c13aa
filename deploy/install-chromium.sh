#!/bin/sh
# Installs Debian's Chromium when it is missing: the rollout viewer's test
# opens the page it generates in it, headless (tests/integration/test_viewer_page.py).
# Needs root and the Debian archive.
set -e
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
