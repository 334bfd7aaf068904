#!/usr/bin/env bash
# The reward sandbox's boundary (workers/rewards/sandbox.py): bubblewrap, setpriv (util-linux) and
# libseccomp. Installs the missing Debian packages where it may (root with apt-get, or sudo
# without a password); otherwise prints the one command to run. Never fails: without them,
# built-in rewards still work and reward code is refused with the reason.
# Quiet when everything is present.
set -uo pipefail

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
# The library list read whole first: `ldconfig -p | grep -q` under pipefail fails at random
# (grep exits at the first match, ldconfig then dies of SIGPIPE), which reported it missing.
libraries=$(/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null)
[[ $libraries == *libseccomp.so.2* ]] || missing+=(libseccomp2)
[ ${#missing[@]} -eq 0 ] && exit 0

command="apt-get install -y ${missing[*]}"
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  as_root=(sudo -n)
  command="sudo $command"
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: reward code needs the sandbox's ${missing[*]} (Debian package names); install them with your" \
       "package manager, or reward functions will answer 'reward code cannot be contained on this machine'" >&2
  exit 0
fi
if [ ${#as_root[@]} -gt 0 ] && ! { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
  echo "setup: reward code needs the sandbox's ${missing[*]}; run: $command" >&2
  exit 0
fi
echo "setup: installing the reward sandbox's ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# Without `apt-get update` first when the package lists already know them (fast, offline-friendly).
if ! "${as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
  "${as_root[@]}" apt-get update -qq >/dev/null 2>&1
  if ! "${as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
    echo "setup: could not install ${missing[*]}; run: $command" >&2
  fi
fi
exit 0
