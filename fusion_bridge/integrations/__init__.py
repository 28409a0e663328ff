"""Adapters that move other people's model code onto the bridge.

`fusion_bridge.integrations.transformers`: Hugging Face transformers MoE models
(`pip install "fusion-bridge[transformers]"`). Nothing here is imported by `import fusion_bridge`;
importing an adapter imports its framework.
"""
