"""The policygroup suite: its helper modules (policies, worker processes) live here, next to
this file, so that every test folder below imports them by name."""
