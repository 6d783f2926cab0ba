#!/bin/bash
# shellcheck shell=bash
# plugin.sh - FlexMig DevStack plugin: DevStack sources this file with
# "<mode> [phase]" (stack install|post-config|extra, unstack, clean), after
# devstack/settings.
#
#   install      pip-installs FlexMig (agent, Nova driver, OVS extension) and
#                builds the data mover
#   post-config  the shared key, agent.conf, nova.conf's compute_driver and
#                [flexmig], what postcopy/split need from libvirt and the
#                kernel, offload.conf and its policy file
#   extra        starts flexmig-agent and flexmig-offload (run_process)
#   unstack      stops them
#   clean        removes everything post-config and install created
#
# Settings are checked at the start of every stack phase: a bad one stops
# stack.sh with a message naming it before any file is written.

_XTRACE_FLEXMIG=$(set +o | grep xtrace)
if [[ "${VERBOSE:-False}" != "True" ]]; then
    set +o xtrace
fi

FLEXMIG_MODES="precopy postcopy split"
FLEXMIG_AGENT_CONF=$FLEXMIG_CONF_DIR/agent.conf
FLEXMIG_OFFLOAD_CONF=$FLEXMIG_CONF_DIR/offload.conf
FLEXMIG_OFFLOAD_POLICY=$FLEXMIG_CONF_DIR/offload-policy.${FLEXMIG_OFFLOAD_POLICY_SOURCE##*.}
# Directories the plugin created (one path a line), removed again by clean.
FLEXMIG_CREATED_DIRS=$FLEXMIG_DATA_DIR/created-dirs
FLEXMIG_USERFAULTFD_SAVED=$FLEXMIG_DATA_DIR/unprivileged_userfaultfd.saved
# First line of every file the plugin owns outside its own directories (the
# libvirt hook, the sysctl file) and of its qemu.conf block: clean removes only
# what carries it.
FLEXMIG_MARKER="# flexmig-devstack: managed by the FlexMig DevStack plugin"
FLEXMIG_QEMU_CONF_SETTING='^[[:space:]]*memory_backing_dir[[:space:]]*='
# Nova options the plugin sets besides [flexmig]; clean deletes them again.
FLEXMIG_NOVA_LIBVIRT_OPTS="file_backed_memory live_migration_permit_post_copy"
# What DevStack's libvirt hypervisor plugin sets; restored by clean.
FLEXMIG_NOVA_DEFAULT_DRIVER=libvirt.LibvirtDriver


# Checks
# ======

function _flexmig_mode_allowed {
    [[ ",$FLEXMIG_ALLOWED_MODES," == *",$1,"* ]]
}

# Nova's driver, the agent and libvirt's settings go where nova-compute runs.
function _flexmig_compute_node {
    is_service_enabled flexmig-agent && is_service_enabled n-cpu
}

function _flexmig_bad {
    _flexmig_errors+=("$*")
}

# _flexmig_check_int NAME MIN MAX
function _flexmig_check_int {
    local name=$1 min=$2 max=$3
    local value=${!name}
    # At most 9 digits: bash arithmetic must not overflow before the range test.
    if [[ ! $value =~ ^[0-9]{1,9}$ ]] || ((10#$value < min || 10#$value > max)); then
        _flexmig_bad "$name='$value': must be an integer from $min to $max"
    fi
}

# _flexmig_check_choice NAME CHOICE...
function _flexmig_check_choice {
    local name=$1
    shift
    local value=${!name} choice
    for choice in "$@"; do
        if [[ $value == "$choice" ]]; then
            return 0
        fi
    done
    _flexmig_bad "$name='$value': must be one of: $*"
}

function _flexmig_check_modes {
    local -a modes
    local mode seen=","
    IFS=, read -r -a modes <<<"$FLEXMIG_ALLOWED_MODES"
    if [[ ${#modes[@]} -eq 0 ]]; then
        _flexmig_bad "FLEXMIG_ALLOWED_MODES is empty: name at least one of ${FLEXMIG_MODES// /, }"
    fi
    for mode in "${modes[@]}"; do
        if [[ " $FLEXMIG_MODES " != *" $mode "* ]]; then
            _flexmig_bad "FLEXMIG_ALLOWED_MODES: '$mode' is not a migration mode" \
                "(comma-separated, no spaces: ${FLEXMIG_MODES// /, })"
        elif [[ $seen == *",$mode,"* ]]; then
            _flexmig_bad "FLEXMIG_ALLOWED_MODES: '$mode' is listed twice"
        fi
        seen+="$mode,"
    done
}

function _flexmig_check_numbers {
    _flexmig_check_int FLEXMIG_AGENT_PORT 1 65535
    _flexmig_check_int FLEXMIG_MAX_DOWNTIME_MS 1 60000
    _flexmig_check_int FLEXMIG_AGENT_MEMORY_BUDGET_MB 0 16777216
    if [[ ! $FLEXMIG_AGENT_TIMEOUT =~ ^[0-9]{1,4}(\.[0-9]+)?$ ]] ||
        [[ $FLEXMIG_AGENT_TIMEOUT =~ ^0+(\.0*)?$ ]]; then
        _flexmig_bad "FLEXMIG_AGENT_TIMEOUT='$FLEXMIG_AGENT_TIMEOUT': must be seconds > 0"
    fi
    if [[ $FLEXMIG_FILE_BACKED_MEMORY_MB != auto ]]; then
        _flexmig_check_int FLEXMIG_FILE_BACKED_MEMORY_MB 1 67108864
    fi
    _flexmig_check_sampling
}

# The agent refuses these at start (flexmig.migration.options, agents/agent/inventory.py):
# say so before anything is configured.
function _flexmig_check_sampling {
    local seconds=$FLEXMIG_DIRTY_SAMPLE_SECONDS sum=0 length lengths
    local -A seen=()
    if [[ ! $seconds =~ ^[0-9]{1,2}(,[0-9]{1,2})*$ ]]; then
        _flexmig_bad "FLEXMIG_DIRTY_SAMPLE_SECONDS='$seconds': comma-separated seconds (1-30)"
        return
    fi
    IFS=, read -r -a lengths <<<"$seconds"
    for length in "${lengths[@]}"; do
        if ((10#$length < 1 || 10#$length > 30)); then
            _flexmig_bad "FLEXMIG_DIRTY_SAMPLE_SECONDS: '$length' is not from 1 to 30 seconds"
        fi
        seen[$((10#$length))]=1
        sum=$((sum + 10#$length))
    done
    if ((${#seen[@]} < 2)); then
        _flexmig_bad "FLEXMIG_DIRTY_SAMPLE_SECONDS='$seconds': needs at least two distinct" \
            "lengths (the model's set and rate are told apart across them)"
    fi
    _flexmig_check_int FLEXMIG_DIRTY_SAMPLE_REFRESH 0 100
    local refresh=$FLEXMIG_DIRTY_SAMPLE_REFRESH
    if [[ $refresh =~ ^[0-9]{1,3}$ ]] && ((10#$refresh > 0 && 10#$refresh < sum)); then
        _flexmig_bad "FLEXMIG_DIRTY_SAMPLE_REFRESH='$refresh': shorter than one sampling," \
            "the ${sum} s of FLEXMIG_DIRTY_SAMPLE_SECONDS ($seconds); 0 turns it off"
    fi
}

function _flexmig_check_names {
    _flexmig_check_choice FLEXMIG_OFFLOAD_PROVIDER xdp tc-flower noop
    _flexmig_check_choice FLEXMIG_AGENT_TCP_FABRIC_TRANSPORT qemu-tcp mover
    if [[ ! $FLEXMIG_AGENT_CGROUP_PARENT =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]]; then
        _flexmig_bad "FLEXMIG_AGENT_CGROUP_PARENT='$FLEXMIG_AGENT_CGROUP_PARENT':" \
            "letters, digits, '_', '.', '-' (at most 64)"
    fi
    if [[ ! $FLEXMIG_OFFLOAD_BRIDGE =~ ^[A-Za-z0-9_.-]{1,15}$ ]]; then
        _flexmig_bad "FLEXMIG_OFFLOAD_BRIDGE='$FLEXMIG_OFFLOAD_BRIDGE': not a bridge name"
    fi
    local ipv4='^([0-9]{1,3}\.){3}[0-9]{1,3}$' ipv6='^[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*$'
    if [[ ! $FLEXMIG_AGENT_LISTEN_ADDRESS =~ $ipv4 && ! $FLEXMIG_AGENT_LISTEN_ADDRESS =~ $ipv6 ]]; then
        _flexmig_bad "FLEXMIG_AGENT_LISTEN_ADDRESS='$FLEXMIG_AGENT_LISTEN_ADDRESS': must be" \
            "this host's management IP address (default: HOST_IP)"
    elif [[ $FLEXMIG_AGENT_LISTEN_ADDRESS =~ ^(0+\.0+\.0+\.0+|[0:]+)$ ]]; then
        _flexmig_bad "FLEXMIG_AGENT_LISTEN_ADDRESS='$FLEXMIG_AGENT_LISTEN_ADDRESS': the agent" \
            "listens on the management address only, never on all addresses"
    fi
    if [[ -n $FLEXMIG_OFFLOAD_UPLINKS && ! $FLEXMIG_OFFLOAD_UPLINKS =~ ^[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*$ ]]; then
        _flexmig_bad "FLEXMIG_OFFLOAD_UPLINKS='$FLEXMIG_OFFLOAD_UPLINKS': port names," \
            "comma-separated, no spaces"
    fi
    if [[ -z $FLEXMIG_OFFLOAD_VM_PORT_PATTERNS || $FLEXMIG_OFFLOAD_VM_PORT_PATTERNS =~ [[:space:]] ]]; then
        _flexmig_bad "FLEXMIG_OFFLOAD_VM_PORT_PATTERNS='$FLEXMIG_OFFLOAD_VM_PORT_PATTERNS':" \
            "regular expressions, comma-separated, no spaces"
    fi
    if [[ -n $FLEXMIG_OFFLOAD_STATS_ENDPOINT && $FLEXMIG_OFFLOAD_STATS_ENDPOINT != /* ]]; then
        _flexmig_bad "FLEXMIG_OFFLOAD_STATS_ENDPOINT='$FLEXMIG_OFFLOAD_STATS_ENDPOINT':" \
            "an absolute path, or empty for none"
    fi
    local name
    for name in FLEXMIG_DIR FLEXMIG_CONF_DIR FLEXMIG_DATA_DIR FLEXMIG_STATE_DIR \
        FLEXMIG_STORE_DIR FLEXMIG_AGENT_KEY_FILE FLEXMIG_LIBVIRT_HOOK FLEXMIG_SYSCTL_FILE \
        FLEXMIG_MACHINE_SLICE_DROPIN FLEXMIG_CGROUP_ROOT; do
        if [[ ${!name} != /* ]]; then
            _flexmig_bad "$name='${!name}': must be an absolute path"
        fi
    done
}

function _flexmig_neutron_ovs_agent {
    is_service_enabled q-agt || is_service_enabled neutron-agent
}

# FLEXMIG_OFFLOAD_PIPELINE, or what this node runs: Neutron's OVS agent means neutron.
function _flexmig_offload_pipeline {
    if [[ -n $FLEXMIG_OFFLOAD_PIPELINE ]]; then
        echo "$FLEXMIG_OFFLOAD_PIPELINE"
    elif _flexmig_neutron_ovs_agent; then
        echo neutron
    else
        echo standalone
    fi
}

# Standalone, flexmig-offload replaces its bridge's OpenFlow controllers and
# sets fail-mode standalone: on the bridge Neutron's agent (ML2/OVS) manages
# that would cut Neutron's connection and switch past the security groups, so
# there it must run in the neutron pipeline.  ovn-controller's pipeline is not
# Neutron's OVS agent's: neither mode runs on its bridge.
function _flexmig_check_offload_bridge {
    local pipeline
    pipeline=$(_flexmig_offload_pipeline)
    if [[ $pipeline != standalone && $pipeline != neutron ]]; then
        _flexmig_bad "FLEXMIG_OFFLOAD_PIPELINE='$pipeline': must be standalone or neutron"
        return 0
    fi
    if [[ $pipeline == neutron ]] && ! _flexmig_neutron_ovs_agent; then
        _flexmig_bad "FLEXMIG_OFFLOAD_PIPELINE=neutron needs Neutron's OVS agent" \
            "(q-agt or neutron-agent) on this node: its FlexMig extension writes the" \
            "port facts flexmig-offload offloads by"
    fi
    if [[ $FLEXMIG_OFFLOAD_CONFIGURE_BRIDGE != True ]]; then
        return 0
    fi
    if [[ $FLEXMIG_OFFLOAD_BRIDGE != br-int && $FLEXMIG_OFFLOAD_BRIDGE != "${OVS_BRIDGE:-br-int}" ]]; then
        return 0
    fi
    if is_service_enabled ovn-controller; then
        _flexmig_bad "flexmig-offload cannot run on $FLEXMIG_OFFLOAD_BRIDGE, which" \
            "ovn-controller manages: give it another FLEXMIG_OFFLOAD_BRIDGE, or set" \
            "FLEXMIG_OFFLOAD_CONFIGURE_BRIDGE=False and connect the bridge yourself, or" \
            "disable_service flexmig-offload"
    elif [[ $pipeline == standalone ]] && _flexmig_neutron_ovs_agent; then
        _flexmig_bad "flexmig-offload would take over $FLEXMIG_OFFLOAD_BRIDGE, which" \
            "Neutron's OVS agent manages (standalone, it replaces the bridge's" \
            "controllers): set FLEXMIG_OFFLOAD_PIPELINE=neutron (the default with" \
            "the agent), or give it another FLEXMIG_OFFLOAD_BRIDGE"
    fi
}

function _flexmig_check_key {
    if [[ -n $FLEXMIG_AGENT_KEY && -n $FLEXMIG_AGENT_KEY_SOURCE ]]; then
        _flexmig_bad "FLEXMIG_AGENT_KEY and FLEXMIG_AGENT_KEY_SOURCE are both set: set one"
    elif [[ -n $FLEXMIG_AGENT_KEY ]]; then
        if [[ ! $FLEXMIG_AGENT_KEY =~ ^[0-9A-Fa-f]{32,}$ ]]; then
            _flexmig_bad "FLEXMIG_AGENT_KEY: must be at least 32 hex digits"
        fi
    elif [[ -n $FLEXMIG_AGENT_KEY_SOURCE ]]; then
        if ! sudo test -f "$FLEXMIG_AGENT_KEY_SOURCE"; then
            _flexmig_bad "FLEXMIG_AGENT_KEY_SOURCE='$FLEXMIG_AGENT_KEY_SOURCE': no such file"
        elif (($(sudo cat "$FLEXMIG_AGENT_KEY_SOURCE" | tr -d '[:space:]' | wc -c) < 16)); then
            _flexmig_bad "FLEXMIG_AGENT_KEY_SOURCE='$FLEXMIG_AGENT_KEY_SOURCE': holds" \
                "fewer than 16 bytes"
        fi
    elif [[ -f $FLEXMIG_AGENT_KEY_FILE ]]; then
        if (($(tr -d '[:space:]' <"$FLEXMIG_AGENT_KEY_FILE" | wc -c) < 16)); then
            _flexmig_bad "FLEXMIG_AGENT_KEY_FILE='$FLEXMIG_AGENT_KEY_FILE' holds fewer than" \
                "16 bytes: remove it or set FLEXMIG_AGENT_KEY or FLEXMIG_AGENT_KEY_SOURCE"
        fi
    elif [[ $FLEXMIG_AGENT_KEY_GENERATE != True ]]; then
        _flexmig_bad "no agent key: set FLEXMIG_AGENT_KEY or FLEXMIG_AGENT_KEY_SOURCE" \
            "(the same on every node) or FLEXMIG_AGENT_KEY_GENERATE=True (single node)"
    fi
}

function _flexmig_check_tls {
    case ${FLEXMIG_AGENT_TLS:-auto} in
        True | true | yes | 1)
            if ! is_service_enabled tls-proxy; then
                _flexmig_bad "FLEXMIG_AGENT_TLS=$FLEXMIG_AGENT_TLS needs DevStack's CA:" \
                    "enable_service tls-proxy"
            fi
            ;;
        auto | False | false | no | 0) ;;
        *) _flexmig_bad "FLEXMIG_AGENT_TLS='$FLEXMIG_AGENT_TLS': True, False or empty" ;;
    esac
}

# What split mode would overwrite on this host must be ours or absent.
function _flexmig_check_split_host {
    if sudo test -e "$FLEXMIG_LIBVIRT_HOOK" &&
        ! sudo grep -qxF "$FLEXMIG_MARKER" "$FLEXMIG_LIBVIRT_HOOK"; then
        _flexmig_bad "FLEXMIG_LIBVIRT_HOOK='$FLEXMIG_LIBVIRT_HOOK' exists and is not" \
            "FlexMig's: choose another name in its qemu.d directory"
    fi
    if [[ -z ${PYTHON:-} || ${PYTHON:-} != /* ]]; then
        _flexmig_bad "PYTHON='${PYTHON:-}': split's libvirt hook needs DevStack's python" \
            "as an absolute path"
    fi
    local others
    others=$(_flexmig_qemu_conf_without_ours | grep -E "$FLEXMIG_QEMU_CONF_SETTING" || true)
    if [[ -n $others && $others != "memory_backing_dir = \"$FLEXMIG_STORE_DIR\"" ]]; then
        _flexmig_bad "$QEMU_CONF already sets '$others': set FLEXMIG_STORE_DIR to that" \
            "directory or remove the line"
    fi
}

# flexmig_check_settings: every setting the stack phases use, before any change.
function flexmig_check_settings {
    local -a _flexmig_errors=()
    _flexmig_check_modes
    _flexmig_check_numbers
    _flexmig_check_names
    _flexmig_check_key
    _flexmig_check_tls
    if is_service_enabled flexmig-offload; then
        if [[ ! -f $FLEXMIG_OFFLOAD_POLICY_SOURCE ]]; then
            _flexmig_bad "FLEXMIG_OFFLOAD_POLICY_SOURCE='$FLEXMIG_OFFLOAD_POLICY_SOURCE': no such file"
        fi
        _flexmig_check_offload_bridge
    fi
    if [[ ${#_flexmig_errors[@]} -eq 0 ]] && _flexmig_compute_node && _flexmig_mode_allowed split; then
        _flexmig_check_split_host
    fi
    if [[ ${#_flexmig_errors[@]} -gt 0 ]]; then
        local msg
        msg=$(printf '\n  %s' "${_flexmig_errors[@]}")
        die $LINENO "FlexMig DevStack plugin: invalid settings (nothing was changed):$msg"
    fi
}


# Helpers
# =======

# _flexmig_make_dir PATH OWNER: create PATH (root's unless OWNER) and remember
# it for clean, unless it exists already.
function _flexmig_make_dir {
    local path=$1 owner=${2:-}
    if [[ -d $path ]]; then
        return 0
    fi
    if [[ -n $owner ]]; then
        sudo install -d -m 0755 -o "$owner" "$path"
    else
        sudo install -d -m 0755 "$path"
    fi
    if ! grep -qxF "$path" "$FLEXMIG_CREATED_DIRS" 2>/dev/null; then
        echo "$path" >>"$FLEXMIG_CREATED_DIRS"
    fi
}

function _flexmig_qemu_conf_without_ours {
    if sudo test -f "$QEMU_CONF"; then
        # Our block is the marker line and the one setting after it.
        sudo sed -e "/^$FLEXMIG_MARKER\$/,+1d" "$QEMU_CONF"
    fi
}

function _flexmig_file_backed_memory_mb {
    if [[ $FLEXMIG_FILE_BACKED_MEMORY_MB == auto ]]; then
        awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo
    else
        echo "$FLEXMIG_FILE_BACKED_MEMORY_MB"
    fi
}


# Install
# =======

function install_flexmig {
    setup_develop "$FLEXMIG_DIR"
    if [[ $FLEXMIG_BUILD_MOVER == True ]]; then
        make -C "$FLEXMIG_DIR/agents/mover"
    fi
}


# Configure
# =========

# The key is written through a 0600 temporary file in the same directory, so
# it is never readable by others, not even for a moment.
function _flexmig_write_key {
    local key=""
    if [[ -n $FLEXMIG_AGENT_KEY ]]; then
        key=$FLEXMIG_AGENT_KEY
    elif [[ -n $FLEXMIG_AGENT_KEY_SOURCE ]]; then
        key=$(sudo cat "$FLEXMIG_AGENT_KEY_SOURCE" | tr -d '[:space:]')
    elif [[ ! -f $FLEXMIG_AGENT_KEY_FILE ]]; then
        key=$(generate_hex_string 32)
    fi
    if [[ -n $key ]]; then
        local tmp
        tmp=$(mktemp "$FLEXMIG_AGENT_KEY_FILE.XXXXXX")
        printf '%s\n' "$key" >"$tmp"
        mv -f "$tmp" "$FLEXMIG_AGENT_KEY_FILE"
    fi
    sudo chown "$STACK_USER" "$FLEXMIG_AGENT_KEY_FILE"
    chmod 0600 "$FLEXMIG_AGENT_KEY_FILE"
}

function _flexmig_configure_agent {
    rm -f "$FLEXMIG_AGENT_CONF"
    iniset "$FLEXMIG_AGENT_CONF" agent listen_address "$FLEXMIG_AGENT_LISTEN_ADDRESS"
    iniset "$FLEXMIG_AGENT_CONF" agent port "$FLEXMIG_AGENT_PORT"
    iniset "$FLEXMIG_AGENT_CONF" agent unix_socket "$FLEXMIG_STATE_DIR/agent.sock"
    iniset "$FLEXMIG_AGENT_CONF" agent key_file "$FLEXMIG_AGENT_KEY_FILE"
    iniset "$FLEXMIG_AGENT_CONF" agent libvirt_uri "$FLEXMIG_LIBVIRT_URI"
    iniset "$FLEXMIG_AGENT_CONF" agent memory_budget_mb "$FLEXMIG_AGENT_MEMORY_BUDGET_MB"
    iniset "$FLEXMIG_AGENT_CONF" agent store_dir "$FLEXMIG_STORE_DIR"
    iniset "$FLEXMIG_AGENT_CONF" agent state_dir "$FLEXMIG_STATE_DIR"
    iniset "$FLEXMIG_AGENT_CONF" agent cgroup_parent "$FLEXMIG_AGENT_CGROUP_PARENT"
    # The engine's options, shared with nova.conf (flexmig/migration/options.py).
    iniset "$FLEXMIG_AGENT_CONF" migration max_downtime_ms "$FLEXMIG_MAX_DOWNTIME_MS"
    iniset "$FLEXMIG_AGENT_CONF" migration allowed_modes "$FLEXMIG_ALLOWED_MODES"
    iniset "$FLEXMIG_AGENT_CONF" migration tcp_fabric_transport "$FLEXMIG_AGENT_TCP_FABRIC_TRANSPORT"
    iniset "$FLEXMIG_AGENT_CONF" migration dirty_sample_seconds "$FLEXMIG_DIRTY_SAMPLE_SECONDS"
    iniset "$FLEXMIG_AGENT_CONF" agent dirty_sample_refresh "$((10#$FLEXMIG_DIRTY_SAMPLE_REFRESH))"
    # Nova drives every live migration here: the agents' own orchestration
    # routes would let any holder of the shared key move VMs behind its back.
    iniset "$FLEXMIG_AGENT_CONF" agent allow_orchestration "$FLEXMIG_AGENT_ALLOW_ORCHESTRATION"
    if _flexmig_agent_tls; then
        _flexmig_configure_agent_tls
    fi
}

# FLEXMIG_AGENT_TLS, or whether DevStack runs its CA (tls-proxy).
function _flexmig_agent_tls {
    case ${FLEXMIG_AGENT_TLS:-auto} in
        True | true | yes | 1) return 0 ;;
        auto) is_service_enabled tls-proxy ;;
        *) return 1 ;;
    esac
}

# The agent's certificate from DevStack's intermediate CA (lib/tls make_cert),
# for the address nova-compute and peer agents reach it at, served with the
# intermediate; the CA bundle verifies peers.  make_cert keeps an existing
# certificate, so a second run changes nothing.
function _flexmig_configure_agent_tls {
    local address=$FLEXMIG_AGENT_LISTEN_ADDRESS
    make_cert "$INT_CA_DIR" flexmig-agent "$address" "IP:$address"
    local cert=$FLEXMIG_CONF_DIR/agent-tls.crt key=$FLEXMIG_CONF_DIR/agent-tls.key
    cat "$INT_CA_DIR/flexmig-agent.crt" "$INT_CA_DIR/cacert.pem" >"$cert"
    sudo install -m 0600 -o "$FLEXMIG_AGENT_USER" "$INT_CA_DIR/private/flexmig-agent.key" "$key"
    iniset "$FLEXMIG_AGENT_CONF" agent tls_cert_file "$cert"
    iniset "$FLEXMIG_AGENT_CONF" agent tls_key_file "$key"
    iniset "$FLEXMIG_AGENT_CONF" agent tls_ca_file "$SSL_BUNDLE_FILE"
}

function _flexmig_configure_nova {
    iniset "$NOVA_CONF" DEFAULT compute_driver "$FLEXMIG_COMPUTE_DRIVER"
    iniset "$NOVA_CONF" flexmig agent_port "$FLEXMIG_AGENT_PORT"
    iniset "$NOVA_CONF" flexmig agent_key_file "$FLEXMIG_AGENT_KEY_FILE"
    iniset "$NOVA_CONF" flexmig agent_timeout "$FLEXMIG_AGENT_TIMEOUT"
    if _flexmig_agent_tls; then
        iniset "$NOVA_CONF" flexmig agent_ca_file "$SSL_BUNDLE_FILE"
    else
        inidelete "$NOVA_CONF" flexmig agent_ca_file
    fi
    iniset "$NOVA_CONF" migration max_downtime_ms "$FLEXMIG_MAX_DOWNTIME_MS"
    iniset "$NOVA_CONF" migration allowed_modes "$FLEXMIG_ALLOWED_MODES"
    iniset "$NOVA_CONF" migration dirty_sample_seconds "$FLEXMIG_DIRTY_SAMPLE_SECONDS"
    if _flexmig_mode_allowed split; then
        # Nova refuses file-backed memory with any RAM overcommit.
        iniset "$NOVA_CONF" libvirt file_backed_memory "$(_flexmig_file_backed_memory_mb)"
        iniset "$NOVA_CONF" DEFAULT ram_allocation_ratio 1.0
    fi
    if _flexmig_mode_allowed postcopy; then
        iniset "$NOVA_CONF" libvirt live_migration_permit_post_copy True
    fi
}

# Split: VMs file-backed in the store on every host from the start (libvirt
# cannot change memory backing during a migration), and the hook that caps an
# incoming QEMU's memory cgroup before its first page arrives.
function _flexmig_configure_split {
    _flexmig_make_dir "$FLEXMIG_STORE_DIR"
    if sudo test -f "$QEMU_CONF"; then
        sudo sed -i -e "/^$FLEXMIG_MARKER\$/,+1d" "$QEMU_CONF"
    fi
    # The checks let through only an equal setting of the operator's own.
    if ! _flexmig_qemu_conf_without_ours | grep -qE "$FLEXMIG_QEMU_CONF_SETTING"; then
        printf '%s\nmemory_backing_dir = "%s"\n' "$FLEXMIG_MARKER" "$FLEXMIG_STORE_DIR" |
            sudo tee -a "$QEMU_CONF" >/dev/null
    fi
    _flexmig_make_dir "$(dirname "$FLEXMIG_LIBVIRT_HOOK")"
    sudo tee "$FLEXMIG_LIBVIRT_HOOK" >/dev/null <<EOF
#!/bin/sh
$FLEXMIG_MARKER
# Split mode: caps an incoming QEMU's memory before its pages arrive.
export FLEXMIG_STATE_DIR=$FLEXMIG_STATE_DIR FLEXMIG_STORE_DIR=$FLEXMIG_STORE_DIR
export FLEXMIG_CGROUP_PARENT=$FLEXMIG_AGENT_CGROUP_PARENT
exec $PYTHON -m agents.agent.libvirt_hook "\$@"
EOF
    sudo chmod 0755 "$FLEXMIG_LIBVIRT_HOOK"
    if _flexmig_cgroup_v2; then
        _flexmig_configure_machine_slice
    fi
}

# True on a unified (cgroup v2) hierarchy, where there is no v1 memory mount.
function _flexmig_cgroup_v2 {
    [[ -f $FLEXMIG_CGROUP_ROOT/cgroup.controllers ]]
}

# cgroup v2: the memory controller must reach libvirt's machine scopes, where
# the hook sets memory.max; systemd enables it below machine.slice once the
# slice accounts memory.
function _flexmig_configure_machine_slice {
    _flexmig_make_dir "$(dirname "$FLEXMIG_MACHINE_SLICE_DROPIN")"
    printf '%s\n[Slice]\nMemoryAccounting=yes\n' "$FLEXMIG_MARKER" |
        sudo tee "$FLEXMIG_MACHINE_SLICE_DROPIN" >/dev/null
    sudo systemctl daemon-reload
    sudo systemctl restart machine.slice
    if ! grep -qw memory "$FLEXMIG_CGROUP_ROOT/cgroup.controllers"; then
        die $LINENO "split needs the cgroup-v2 memory controller, and" \
            "$FLEXMIG_CGROUP_ROOT/cgroup.controllers has none (kernel cgroup_disable=memory?)"
    fi
}

# Postcopy: libvirt runs QEMU unprivileged, and userfaultfd then needs this.
function _flexmig_configure_postcopy {
    if [[ ! -f $FLEXMIG_USERFAULTFD_SAVED ]]; then
        sysctl -n vm.unprivileged_userfaultfd >"$FLEXMIG_USERFAULTFD_SAVED"
    fi
    printf '%s\nvm.unprivileged_userfaultfd = 1\n' "$FLEXMIG_MARKER" |
        sudo tee "$FLEXMIG_SYSCTL_FILE" >/dev/null
    sudo sysctl -w vm.unprivileged_userfaultfd=1
}

function _flexmig_configure_offload {
    install -m 0644 "$FLEXMIG_OFFLOAD_POLICY_SOURCE" "$FLEXMIG_OFFLOAD_POLICY"
    rm -f "$FLEXMIG_OFFLOAD_CONF"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload provider "$FLEXMIG_OFFLOAD_PROVIDER"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload policy_file "$FLEXMIG_OFFLOAD_POLICY"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload bridge "$FLEXMIG_OFFLOAD_BRIDGE"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload configure_bridge "$FLEXMIG_OFFLOAD_CONFIGURE_BRIDGE"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload vm_port_patterns "$FLEXMIG_OFFLOAD_VM_PORT_PATTERNS"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload uplinks "$FLEXMIG_OFFLOAD_UPLINKS"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload stats_endpoint "$FLEXMIG_OFFLOAD_STATS_ENDPOINT"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload status_file "$FLEXMIG_STATE_DIR/offload-status.json"
    # The agent moves migrating VMs' flows through the control interface (same key).
    iniset "$FLEXMIG_OFFLOAD_CONF" offload control_key_file "$FLEXMIG_AGENT_KEY_FILE"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload pipeline "$(_flexmig_offload_pipeline)"
    if [[ $(_flexmig_offload_pipeline) == neutron ]]; then
        _flexmig_configure_neutron_agent
    fi
}

# Neutron's OVS agent loads FlexMig's L2 agent extension, which writes the port
# facts (port security, network, QoS policy) flexmig-offload reads; the agent
# runs as the stack user.  The plugin's post-config runs before the agent starts.
function _flexmig_configure_neutron_agent {
    local agent_conf=${NEUTRON_CORE_PLUGIN_CONF:-}
    if [[ -z $agent_conf ]]; then
        die $LINENO "FlexMig: NEUTRON_CORE_PLUGIN_CONF is not set: is Neutron configured?"
    fi
    _flexmig_make_dir "$(dirname "$FLEXMIG_OFFLOAD_NEUTRON_PORTS_FILE")" "$STACK_USER"
    iniset "$FLEXMIG_OFFLOAD_CONF" offload neutron_ports_file "$FLEXMIG_OFFLOAD_NEUTRON_PORTS_FILE"
    local extensions
    extensions=$(iniget "$agent_conf" agent extensions)
    if [[ ! ,$extensions, =~ ,flexmig_offload, ]]; then
        extensions=${extensions:+$extensions,}flexmig_offload
    fi
    iniset "$agent_conf" agent extensions "$extensions"
    iniset "$agent_conf" flexmig_offload ports_file "$FLEXMIG_OFFLOAD_NEUTRON_PORTS_FILE"
}

function configure_flexmig {
    mkdir -p "$FLEXMIG_DATA_DIR"
    _flexmig_make_dir "$FLEXMIG_CONF_DIR" "$STACK_USER"
    _flexmig_write_key
    if _flexmig_compute_node; then
        _flexmig_configure_agent
        _flexmig_configure_nova
        if _flexmig_mode_allowed split; then
            _flexmig_configure_split
        fi
        if _flexmig_mode_allowed postcopy; then
            _flexmig_configure_postcopy
        fi
        if _flexmig_mode_allowed split; then
            # qemu.conf and hooks are read when libvirtd starts.
            restart_service libvirtd
        fi
    elif is_service_enabled flexmig-agent; then
        echo "flexmig-agent: n-cpu is not enabled on this node; no agent here"
    fi
    if is_service_enabled flexmig-offload; then
        _flexmig_configure_offload
    fi
}


# Start and stop
# ==============

function start_flexmig {
    local bin_dir
    bin_dir=$(get_python_exec_prefix)
    _flexmig_make_dir "$FLEXMIG_STATE_DIR"
    if _flexmig_compute_node; then
        run_process flexmig-agent "$bin_dir/flexmig-agent --config-file $FLEXMIG_AGENT_CONF" \
            "" "$FLEXMIG_AGENT_USER"
    fi
    if is_service_enabled flexmig-offload; then
        run_process flexmig-offload \
            "$bin_dir/flexmig-offload --config-file $FLEXMIG_OFFLOAD_CONF" \
            "" "$FLEXMIG_OFFLOAD_USER"
    fi
}

function stop_flexmig {
    stop_process flexmig-agent
    stop_process flexmig-offload
}


# Clean
# =====

function _flexmig_clean_nova {
    if [[ ! -f ${NOVA_CONF:-} ]]; then
        return 0
    fi
    # The whole [flexmig] and [migration] sections: header and every line up to the next one.
    local section
    for section in flexmig migration; do
        sed -i -e "/^\\[$section\\]/,/^\\[/{/^\\[$section\\]/d;/^\\[/!d;}" "$NOVA_CONF"
    done
    local opt
    for opt in $FLEXMIG_NOVA_LIBVIRT_OPTS; do
        inidelete "$NOVA_CONF" libvirt "$opt"
    done
    if [[ $(iniget "$NOVA_CONF" DEFAULT compute_driver) == "$FLEXMIG_COMPUTE_DRIVER" ]]; then
        iniset "$NOVA_CONF" DEFAULT compute_driver "$FLEXMIG_NOVA_DEFAULT_DRIVER"
        inidelete "$NOVA_CONF" DEFAULT ram_allocation_ratio
    fi
}

function _flexmig_clean_host {
    local restart=False
    if sudo test -f "${QEMU_CONF:-}" && sudo grep -qxF "$FLEXMIG_MARKER" "$QEMU_CONF"; then
        sudo sed -i -e "/^$FLEXMIG_MARKER\$/,+1d" "$QEMU_CONF"
        restart=True
    fi
    if sudo test -f "$FLEXMIG_LIBVIRT_HOOK" && sudo grep -qxF "$FLEXMIG_MARKER" "$FLEXMIG_LIBVIRT_HOOK"; then
        sudo rm -f "$FLEXMIG_LIBVIRT_HOOK"
        restart=True
    fi
    if [[ $restart == True ]]; then
        restart_service libvirtd
    fi
    if sudo test -f "$FLEXMIG_SYSCTL_FILE" && sudo grep -qxF "$FLEXMIG_MARKER" "$FLEXMIG_SYSCTL_FILE"; then
        sudo rm -f "$FLEXMIG_SYSCTL_FILE"
    fi
    if sudo test -f "$FLEXMIG_MACHINE_SLICE_DROPIN" &&
        sudo grep -qxF "$FLEXMIG_MARKER" "$FLEXMIG_MACHINE_SLICE_DROPIN"; then
        sudo rm -f "$FLEXMIG_MACHINE_SLICE_DROPIN"
        sudo systemctl daemon-reload
    fi
    if [[ -f $FLEXMIG_USERFAULTFD_SAVED ]]; then
        sudo sysctl -w "vm.unprivileged_userfaultfd=$(cat "$FLEXMIG_USERFAULTFD_SAVED")"
    fi
}

function cleanup_flexmig {
    _flexmig_clean_nova
    _flexmig_clean_host
    sudo rm -f "$FLEXMIG_AGENT_KEY_FILE" "$FLEXMIG_AGENT_CONF" "$FLEXMIG_OFFLOAD_CONF" \
        "$FLEXMIG_OFFLOAD_POLICY"
    if [[ -f $FLEXMIG_CREATED_DIRS ]]; then
        local dir
        # Newest first: a directory made inside another goes before it.
        while read -r dir; do
            sudo rm -rf "$dir"
        done < <(tac "$FLEXMIG_CREATED_DIRS")
    fi
    rm -rf "$FLEXMIG_DATA_DIR"
    if [[ $FLEXMIG_BUILD_MOVER == True && -d $FLEXMIG_DIR/agents/mover ]]; then
        make -C "$FLEXMIG_DIR/agents/mover" clean
    fi
    pip_uninstall flexmig
}


# Dispatch
# ========

if is_service_enabled flexmig-agent flexmig-offload; then
    case "${1:-}/${2:-}" in
        stack/install)
            echo_summary "Installing FlexMig"
            flexmig_check_settings
            install_flexmig
            ;;
        stack/post-config)
            echo_summary "Configuring FlexMig"
            flexmig_check_settings
            configure_flexmig
            ;;
        stack/extra)
            echo_summary "Starting FlexMig"
            flexmig_check_settings
            start_flexmig
            ;;
        unstack/*)
            stop_flexmig
            ;;
        clean/*)
            cleanup_flexmig
            ;;
    esac
fi

$_XTRACE_FLEXMIG
