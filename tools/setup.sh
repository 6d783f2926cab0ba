#!/usr/bin/env bash
# One idempotent setup step: Debian packages, the Python virtualenv and the
# guest image.  Safe to run again; it only does what is missing.
set -Eeuo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

APT_PACKAGES=(
  qemu-system-x86 qemu-utils
  libvirt-daemon-system libvirt-clients libvirt-dev pkg-config
  openvswitch-switch openvswitch-common
  busybox-static cpio kmod tini
  clang llvm libbpf-dev bpftool libelf-dev zlib1g-dev
  libclang-rt-14-dev
  libfabric-dev libfabric-bin
  iperf3 socat iproute2 ethtool iputils-ping util-linux
  # Neutron's OVS firewall clears conntrack entries with it (the test of the
  # offload beside Neutron's agent).
  conntrack
  gcc make libc6-dev shellcheck
  python3-venv python3-dev
)

# Progress goes to the terminal, one line per step; what the tools print (apt,
# pip's and eventlet's warnings, compilers) goes to a log shown on failure.
mkdir -p .cache
SETUP_LOG="$ROOT/.cache/setup.log"
: >"$SETUP_LOG"
STEP="starting"

log() { echo "setup: $*" >&2; }
# The version a tree without git history installs as (pbr needs one).
UNVERSIONED=0.0.0

step() {
  STEP=$*
  log "$STEP"
  echo "== $STEP" >>"$SETUP_LOG"
}

on_failure() {
  local rc=$?
  log "FAILED while $STEP (exit $rc); the last lines of $SETUP_LOG:"
  tail -n 25 "$SETUP_LOG" | sed 's/^/    /' >&2
  log "the whole log: $SETUP_LOG"
  exit "$rc"
}
trap on_failure ERR

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    log "installing Debian packages needs root (run as root or with sudo)"
    exit 1
  fi
}

install_debian_packages() {
  local missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$pkg")
  done
  # The guest kernel is fetched with apt-get download: it needs package lists.
  if [ ${#missing[@]} -eq 0 ] && compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then
    return
  fi
  need_root
  step "installing Debian packages: ${missing[*]:-(package lists only)}"
  # Package scripts must not start the machine's own libvirtd/OVS: every lab
  # host runs its own daemons inside its namespaces.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
  fi
  # Wait for another apt (unattended-upgrades, a parallel setup) instead of failing.
  local apt=(apt-get -q -o DPkg::Lock::Timeout=300)
  "${apt[@]}" update >>"$SETUP_LOG" 2>&1
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends \
      "${missing[@]}" >>"$SETUP_LOG" 2>&1
  fi
  [ "$created_policy" -eq 1 ] && rm -f "$policy"
  return 0
}

install_python() {
  local stamp=.venv/.installed
  local want
  want=$(cat setup.cfg setup.py pyproject.toml requirements.txt test-requirements.txt \
    constraints.txt tests/rig/pyproject.toml | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  # pbr takes the version from git; a tree without its history (an exported
  # archive) has none to take, so it is given one.  Clones, shallow ones
  # included, have a commit to count from.
  if ! git -C "$ROOT" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    log "no git history here: installing as version $UNVERSIONED"
    export PBR_VERSION=$UNVERSIONED
  fi
  # pbr's editable install keeps FlexMig's metadata in the virtualenv; an
  # egg-info the earlier setuptools install left in the tree would shadow it
  # (stale entry points) for anything run from here.
  rm -rf flexmig.egg-info
  step "creating the virtualenv in .venv (Python packages, a few minutes the first time)"
  {
    python3 -m venv .venv
    .venv/bin/pip install -q -U pip setuptools wheel
    # The gate's way: requirements under the upper constraints.
    .venv/bin/pip install -q -c constraints.txt -r requirements.txt -r test-requirements.txt
    .venv/bin/pip install -q -c constraints.txt -e .
    # The lab (tests/rig): a test rig beside the product, never inside it.
    .venv/bin/pip install -q -c constraints.txt --no-build-isolation -e tests/rig
    # The runner of the test command's stages (tools/test.sh: tox -e pep8, py3,
    # functional), as the gate runs them.
    .venv/bin/pip install -q -c constraints.txt tox
  } >>"$SETUP_LOG" 2>&1
  echo "$want" > "$stamp"
}

# Nova's functional-test harness loads the API pipeline from the
# etc/nova/api-paste.ini that only Nova's source distribution carries.
fetch_nova_api_paste() {
  local version paste=.cache/nova/api-paste.ini
  version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("nova"))')
  if [ -f "$paste" ] && [ "$(cat .cache/nova/version 2>/dev/null)" = "$version" ]; then
    return
  fi
  step "fetching api-paste.ini from the nova $version source distribution"
  local tmp
  tmp=$(mktemp -d)
  .venv/bin/pip download -q --no-deps --no-binary :all: -d "$tmp" "nova==$version" \
    >>"$SETUP_LOG" 2>&1
  mkdir -p .cache/nova
  tar -xzf "$tmp/nova-$version.tar.gz" -C "$tmp" "nova-$version/etc/nova/api-paste.ini"
  cp "$tmp/nova-$version/etc/nova/api-paste.ini" "$paste"
  echo "$version" > .cache/nova/version
  rm -rf "$tmp"
}

install_debian_packages
install_python
fetch_nova_api_paste
step "building the data mover"
make -s -C agents/mover >>"$SETUP_LOG" 2>&1
step "building the XDP eSwitch, the lab's packet generators and the benchmarks' BPF objects"
{
  make -s -C ovs_ext/providers/xdp
  make -s -C tests/rig/flexmig_lab/traffic
  make -s -C tests/bench/bpf
} >>"$SETUP_LOG" 2>&1
step "building the guest image (kernel, initramfs, QEMU 10)"
.venv/bin/flexmig-lab image build >>"$SETUP_LOG" 2>&1
log "ready (details in $SETUP_LOG)"
