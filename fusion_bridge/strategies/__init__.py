"""One file per strategy. Register a new one in fusion_bridge/registry.py."""
