"""torchyard service: REST API, ledger, dispatch and reconcile loops. Never imports torch."""
