"""Experts: the host pool (source of truth), the device cache, placement policy and
the bandwidth profile (B_P, B_H) that the policy reads. Import the submodules
directly (`from ftjax.experts.pool import HostExpertPool`)."""
