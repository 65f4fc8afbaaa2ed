"""Reading captures for their faults and differences: verify, rollback forensics, diff, and inspect's summary."""
