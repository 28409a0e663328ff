"""The command-line tools (`python -m fusion_bridge ...`): explain, info, parity, tune, bench,
matrix, and the process-group launcher they share. They use the bridge's public API only."""
