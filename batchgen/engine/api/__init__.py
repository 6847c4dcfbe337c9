"""The engine's contracts with its callers (vLLM-style names): what goes in and comes back, and the
engine settings; nothing here runs a model.
"""
