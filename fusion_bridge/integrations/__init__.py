"""Adapters that move other people's model code onto the bridge.

`fusion_bridge.integrations.transformers`: Hugging Face transformers MoE models
(`pip install "fusion-bridge[transformers]"` installs the tested transformers). The adapters work
on the model objects the caller already built; `import fusion_bridge` never imports them, and they
never import the framework themselves.
"""
