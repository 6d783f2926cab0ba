"""What the fault campaign found, cell by cell: the table's closing notes.

Kept apart from the harness (tests/bench/fault_campaign.py) because it grows
with every finding; each entry says what happened, why, and what changed.
"""

FINDINGS = (
    "postcopy over the mover transport: a resume needs a fresh mover pair (the old "
    "one dies with the stream); before that fix every resume went to the dead "
    "pair's socket and the VM stayed paused on both hosts (postcopy/mover/cut-30s).",
    "libvirt 9.0 does not know QEMU >= 9.1's postcopy-recover-setup state: it "
    "reports a resume failed that QEMU then completes (the job now waits on QEMU's "
    "own state), and in 2 of this cell's 4 runs on 9.0 its resume call never "
    "returned and held the VM's migration job, so no later resume could start: the VM stays "
    "paused on both hosts (counted lost here) until libvirtd is restarted on the "
    "source. The same stuck job lost the VM of postcopy/mover/kill-dst-mover on 9.0: "
    "libvirt's migration call itself never returned after the broken postcopy was "
    "paused, so no resume could start. "
    "With libvirt 11.3 (FLEXMIG_LAB_LIBVIRT=backports) the mover faults at "
    "the postcopy switch end with postcopy never taking over (the VM runs on the "
    "source): the switch returns before QEMU has handed over, so these cells do not "
    "reach a resume there; and the destination's libvirtd 11.3 segfaulted (in "
    "libvirt_driver_qemu.so) handling the broken postcopy of a qemu-tcp cut-30s run, "
    "after which no resume could reach it.",
    "Since the planner's preempt rule (flexmig/policy/transport.py preempt_conflict), "
    "a postcopy plan between libvirt >= 10 hosts goes over qemu-tcp: on 11.3 the "
    "postcopy/mover cells do not apply (2 of 2 runs of kill-src-mover/postcopy-switch "
    "ran over qemu-tcp, counted n/a). Their earlier 11.3 runs predate that rule and did "
    "ride the mover; their 'postcopy never took over' fits the preempt channel failure "
    "reproduced with the rule off ('Failed to establish preempt channel').",
    "A source agent killed before its switch to postcopy left libvirt's precopy with no "
    "driver: the restarted agent followed it for 900 s while it iterated 159 rounds (14 "
    "GiB for the 256 MiB guest) and then gave up (postcopy/mover/kill-src-agent/round). "
    "Since then the restarted agent aborts a precopy whose last 3 rounds left no less "
    "to send than before them, converge_timeout after the restart "
    "(flexmig/migration/reconcile.py abort_orphaned_precopy): the round runs of "
    "postcopy/*/kill-src-agent end in about a minute with the VM on the source.",
    "A destination QEMU killed after the switch to postcopy (postcopy/*/kill-dst-qemu/"
    "postcopy-switch and /switchover, which comes after the switch in a hybrid) takes "
    "the guest's newest pages with it: postcopy recovery mends a broken stream between "
    "two living QEMUs, not a dead one, so these cells lose the VM by design of postcopy, "
    "not by a fault FlexMig can repair (the source keeps it paused as at the switch, "
    "older than its disks). The first run (qemu-tcp, libvirt 9.0) tried 14 resumes for "
    "120 s into a domain that no longer existed; the job now stops at the destination "
    "libvirt's answer and says the VM must be started again from its disks "
    "(flexmig/migration/recovery.py destination_lost). Where that risk is not wanted, "
    "postcopy stays out of [migration] allowed_modes.",
    "A source libvirtd restarted at the switch to postcopy "
    "(postcopy/qemu-tcp/restart-src-libvirtd/postcopy-switch): QEMU's stream outlived "
    "it and the VM landed on B, but the job asked where the VM ran through its domain "
    "handle, dead with the old daemon ('client socket is closed'), could not tell, "
    "resumed 14 times ('Domain not found') and reported the VM paused on both hosts. "
    "The job now reads the source's state on a connection of its own "
    "(libvirt_job._source_state), and on the Nova path on Nova's Host connection, "
    "which Nova reopens after a daemon restart. The harness's restart now ends "
    "libvirtd with SIGKILL after 30 s of SIGTERM, as systemd would: a 9.0 daemon "
    "busy with a migration outlived 30 s of SIGTERM and stopped the campaign.",
    "A link cut at the switchover point of a hybrid postcopy "
    "(postcopy/qemu-tcp/cut-30s/switchover, libvirt 9.0, 2 runs, 2 VMs lost, lab kept "
    "for the second): the plan's switch came 2.9 s into the cut, when the stream had "
    "long stopped. The source QEMU stopped the guest and sent its device state into the "
    "dead link; the destination never got it, and its libvirtd killed the incoming QEMU "
    "when the peers' keepalive expired (30 s: 'connection closed due to keepalive "
    "timeout', then 'terminating on signal 15 from libvirtd'). The source then held "
    "the only whole copy of the VM, yet QEMU refuses both 'cont' ('Migration is not "
    "finalized yet') and 'migrate_cancel' ('Postcopy migration in progress, cannot "
    "cancel') once postcopy has started, and libvirt's resume waits on the migration "
    "job: nothing can run it again. The controller now holds a switch while the "
    "stream has not moved for 1 s (flexmig/migration/controller.py "
    "SWITCH_NEEDS_MOVE_S), so the stall watchdog aborts the precopy with the VM whole "
    "on the source. Left: a cut in the second before a switch (the hold's threshold), "
    "or after it before the device state reached the destination.",
    "A source libvirtd restarted at the switchover of a precopy "
    "(precopy/qemu-tcp and split/qemu-tcp restart-src-libvirtd/switchover, one run "
    "each): libvirt's call ended ('End of file while reading data') while QEMU "
    "completed the migration, and the job reported failed with the VM running on B. "
    "The job now asks where the VM is before it reports a failure "
    "(libvirt_job._landed_after_failure: up to 30 s while the source cannot say).",
)
