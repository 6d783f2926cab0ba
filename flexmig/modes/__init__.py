"""Migration modes executed through libvirt: precopy, hybrid postcopy, split.

Each mode is a small plugin (found through the ``flexmig.modes`` entry point)
that turns a policy Decision into libvirt flags and reacts to job progress;
the job driver in ``job.py`` owns the loop, the watchdogs and recovery.
"""
