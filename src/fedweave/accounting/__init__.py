"""Closed-form communication and storage accounting of the papers' methods (checked against the ledger)."""
