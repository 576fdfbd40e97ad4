#!/usr/bin/env bash
# Debian packages the multi-host tests drive for real: iproute2 (hosts as network namespaces),
# openssh-server (SSHJob through a real sshd), slurm-wlm and munge (SlurmJob through a real
# slurmctld + slurmd, configured by scripts/slurm-local.sh). Installed when missing, as root or
# with passwordless sudo; otherwise it says how and leaves it (those tests then fail in CI, where
# the suite runs as root, and are skipped with the reason elsewhere). Starts no daemon: the tests
# start and stop their own.
set -u
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh-keygen >/dev/null 2>&1 || missing+=(openssh-client)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif sudo -n true >/dev/null 2>&1; then
  SUDO="sudo -n"
else
  echo "install-test-daemons: missing ${missing[*]}; run 'sudo apt-get install --no-install-recommends ${missing[*]}' for the multi-host tests"
  exit 0
fi
echo "install-test-daemons: installing ${missing[*]} (apt)"
$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || echo "install-test-daemons: could not install ${missing[*]}; the multi-host tests will fail in CI"
# Debian's postinst may start daemons where an init system runs; the tests need none of them
exit 0
