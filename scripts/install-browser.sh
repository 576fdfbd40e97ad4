#!/usr/bin/env bash
# Debian's Chromium for the browser test (tests/test_browser.py drives it with Playwright through
# executable_path; no browser is ever downloaded). Installs the apt package when it is missing and
# this user may (root, or sudo without a password); otherwise says how and leaves it: that one
# test then skips outside CI.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif sudo -n true >/dev/null 2>&1; then
  SUDO="sudo -n"
else
  echo "install-browser: chromium is missing; run 'sudo apt-get install chromium' for the browser test"
  exit 0
fi
echo "install-browser: installing Debian's chromium (apt)"
$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
  || echo "install-browser: could not install chromium; the browser test will be skipped (fails in CI)"
exit 0
